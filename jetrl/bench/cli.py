"""``jetrl bench`` arguments and entry: the subcommand's options, resolved into a run.

``jetrl/cli.py`` adds the ``bench`` subparser with :func:`add_arguments` and dispatches to
:func:`run`; ``python -m jetrl.bench ...`` is the same command. Only argparse is imported here:
the sections (torch, the engine, the trainer) load when the command runs.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

SECTION_KEYS = "abcdefg"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sections", default=",".join(SECTION_KEYS), metavar="a,b,...",
                   help="which sections to run: a quant kernels, b Float8Linear, c decode GEMMs, d decode step, "
                        "e rollout, f training phase, g RL step (default: all)")
    p.add_argument("--out", default="runs/bench", metavar="DIR", help="writes DIR/bench.json (default runs/bench)")
    p.add_argument("--smoke", action="store_true",
                   help="every section at tiny shapes, 1-2 iterations: on CPU by default (emulated FP8, no CUDA "
                        "graphs; the CI test), or --device cuda for a quick GPU check; timings meaningless")
    p.add_argument("--device", default=None, help="default: cuda, or cpu with --smoke")
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers of the 8B-shaped model in d, e (default 36)")
    p.add_argument("--train-layers", type=int, default=None,
                   help="decoder layers of the 8B-shaped model in f, g (default 36: Qwen3-8B; fewer run quicker)")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="sequences per forward/backward in f, g (per_device_train_batch_size; default 8): "
                        "fewer fit more layers into memory")
    p.add_argument("--no-long-context", dest="long_context", action="store_false",
                   help="skip the long-context rollout config of section e")
    p.add_argument("--torchao", action="store_true",
                   help="(b) also times torchao's blockwise FP8 training linear, the same recipe, as a second "
                        "baseline (needs torchao importable; (b) took ~3 minutes with it on an H200)")
    p.add_argument("--deterministic", action="store_true",
                   help="every section under torch's deterministic algorithms and a fixed cuBLAS workspace, as "
                        "`jetrl train deterministic=true` runs (jetrl/run/determinism.py): what that setting costs")
    p.add_argument("--in-process", action="store_true",
                   help="run every section in this process (default on CUDA: one child process per section, so "
                        "a section that corrupts CUDA state -- a sticky kernel fault, a broken graph capture -- "
                        "cannot take the sections after it down)")


def parse_sections(text: str) -> str:
    keys = "".join(ch for ch in text.lower() if ch not in ", ")
    bad = sorted(set(keys) - set(SECTION_KEYS))
    if not keys or bad:
        raise ValueError(f"--sections {text!r}: use letters from {','.join(SECTION_KEYS)}, e.g. --sections a,b,c")
    return "".join(k for k in SECTION_KEYS if k in keys)


def command_line(args: argparse.Namespace, sections: str, out: str | None = None) -> str:
    parts = ["jetrl", "bench", "--sections", ",".join(sections), "--out", out or args.out]
    parts += ["--smoke"] if args.smoke else []
    for flag, value in (("--device", args.device), ("--layers", args.layers), ("--train-layers", args.train_layers),
                        ("--micro-batch", args.micro_batch)):
        if value is not None:
            parts += [flag, str(value)]
    parts += [] if args.long_context else ["--no-long-context"]
    parts += ["--torchao"] if args.torchao else []
    parts += ["--deterministic"] if args.deterministic else []
    return shlex.join(parts)


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    import torch

    from jetrl.bench.runner import run_bench
    from jetrl.bench.shapes import h200_config, smoke_config
    from jetrl.run.determinism import deterministic_algorithms

    sections = parse_sections(args.sections)
    try:
        device = torch.device(args.device or ("cpu" if args.smoke else "cuda"))
    except RuntimeError as err:
        raise ValueError(f"--device {args.device!r} is not a device; use cpu, cuda or cuda:N") from err
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise ValueError(f"--out {args.out} is a file; pass a directory for bench.json")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("jetrl bench measures a CUDA GPU and none is available; run `jetrl bench --smoke` on CPU")
    if device.type != "cuda" and not args.smoke:
        raise ValueError(f"the full-size bench (8B shapes) runs on a CUDA GPU, not {device}; add --smoke for the "
                         "tiny CPU run")
    preset = smoke_config if args.smoke else h200_config
    sizes = {k: v for k, v in (("layers", args.layers), ("train_layers", args.train_layers),
                               ("micro_batch", args.micro_batch)) if v is not None}
    cfg = replace(preset(long_context=args.long_context, **sizes), torchao=args.torchao)
    child = None
    if device.type == "cuda" and len(sections) > 1 and not args.in_process:
        def child(key: str, out: str) -> list[str]:  # the argv of a child process running section ``key`` alone
            return [*shlex.split(command_line(args, key, out))[1:], "--in-process"]
    with deterministic_algorithms(args.deterministic):  # before any section starts cuBLAS
        return run_bench(cfg, sections, args.out, device, command_line(args, sections), child_argv=child)
