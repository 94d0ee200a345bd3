"""Run the sections of ``jetrl bench``, then print the table, the JSON line, and save.

Each section is a function ``(BenchConfig, device) -> list[row]`` (report.py says what a row
holds). A section that raises is recorded with its error and traceback, device memory is
released, and the next section runs; rows record their own smaller failures.

Isolation: on CUDA each section runs in its own child process (``python -m jetrl bench
--sections K --in-process``), and this process only merges their ``bench.json``. A Python
exception cannot hurt the next section, but CUDA state can: a sticky kernel fault poisons the
context, and a failed graph capture can leave the default generator in capture mode (seen on the
H200: every later ``torch.randn`` raised "Offset increment outside graph capture"). A child that
dies without its JSON is recorded as a section error with its exit code. Progress lines
(``[bench] ...``) go to stdout as sections finish, with their wall time and peak device memory;
the table comes last, then one JSON line (the summary: failed checks, errors, every targeted
ratio, the JSON path). ``<out>/bench.json`` holds everything: the environment (device, torch,
CUDA, Triton, transformers, git commit, the JETRL_* switches set), the date, the command line, the config, every
row.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from jetrl.bench import kernels, rollout, training
from jetrl.bench.models import free_device_memory
from jetrl.bench.report import format_table, summarize, to_json
from jetrl.bench.shapes import BenchConfig
from jetrl.bench.timing import HBM_BYTES_PER_S
from jetrl.exact import exact_requested

Section = Callable[[BenchConfig, torch.device], list[dict[str, Any]]]
SECTIONS: dict[str, tuple[str, Section]] = {
    "a": ("quant kernels: TB/s vs copy ceiling", kernels.quant_kernels),
    "b": ("Float8Linear vs BF16 nn.Linear", kernels.float8_linear),
    "c": ("decode GEMMs under CUDA graphs", kernels.decode_gemms),
    "d": ("decode step vs bytes floor", rollout.decode_step),
    "e": ("rollout tok/s", rollout.rollout_throughput),
    "f": ("training phase", training.training_phase),
    "g": ("end-to-end RL step", training.rl_step),
}


def run_section(key: str, cfg: BenchConfig, device: torch.device) -> dict[str, Any]:
    title, fn = SECTIONS[key]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    rows, error, trace = [], None, None
    try:
        rows = fn(cfg, device)
    except Exception as exc:  # noqa: BLE001 -- recorded, printed; the exit code says the run is incomplete
        error, trace = f"{type(exc).__name__}: {exc}", traceback.format_exc()
        print(trace, file=sys.stderr)
    finally:
        free_device_memory()
    wall = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    problems = sum(1 for r in rows if r.get("error") or r.get("check") == "FAILED")
    print(f"[bench] ({key}) {title}: {wall:.1f} s, {len(rows)} rows"
          + (f", peak {peak:.1f} GiB" if peak is not None else "")
          + (f", {problems} failing rows" if problems else "") + (f", SECTION ERROR {error}" if error else ""),
          flush=True)
    return {"title": title, "wall_s": wall, "peak_mem_gib": peak, "rows": rows, "error": error, "traceback": trace}


def run_child(key: str, argv: list[str], out_dir: str) -> dict[str, Any]:
    """Section ``key`` in a child process running ``jetrl <argv>``; its result as :func:`run_section` returns it."""
    title = SECTIONS[key][0]
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "jetrl", *argv], check=False, stdout=subprocess.PIPE, text=True)
    for line in done.stdout.splitlines():  # the child's progress line; its own table and JSON line are dropped
        if line.startswith("[bench] ("):
            print(line, flush=True)
    try:
        return json.loads((Path(out_dir) / "bench.json").read_text())["sections"][key]
    except (OSError, ValueError, KeyError) as exc:
        error = f"child process exited {done.returncode} without its result ({type(exc).__name__}: {exc})"
        print(f"[bench] ({key}) {title}: SECTION ERROR {error}", flush=True)
        return {"title": title, "wall_s": time.perf_counter() - start, "peak_mem_gib": None, "rows": [],
                "error": error, "traceback": done.stdout[-4000:]}


def run_bench(cfg: BenchConfig, sections: str, out_dir: str, device: torch.device, command: str,
              child_argv: Callable[[str, str], list[str]] | None = None) -> int:
    """Run ``sections`` (letters a-g), print the table and the JSON line, write ``out_dir/bench.json``.

    ``child_argv(key, out)``, if given, is the command line (after ``jetrl``) that runs section
    ``key`` alone writing ``out/bench.json``: each section then runs in its own process.
    """
    meta = environment(device, cfg, command)
    mode = " | EXACT MODE (JETRL_EXACT=1: batch-invariant kernels, not the fast ones)" if exact_requested() else ""
    print(f"[bench] {meta['device']} | torch {meta['torch']} | triton {meta['triton']} | {meta['date']}{mode}", flush=True)
    start = time.perf_counter()
    if child_argv is None:
        results = {key: run_section(key, cfg, device) for key in sections}
    else:
        meta["isolation"] = "one child process per section"
        results = {}
        for key in sections:
            child_out = str(Path(out_dir) / "sections" / key)
            results[key] = run_child(key, child_argv(key, child_out), child_out)
    meta["wall_s"] = time.perf_counter() - start
    summary = summarize(results)
    path = Path(out_dir) / "bench.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_json({"meta": meta, "sections": results, "summary": summary}))
    print()
    print(format_table(results, smoke=cfg.smoke))
    line = {"jetrl_bench": "summary", "smoke": cfg.smoke, "device": meta["device"], "wall_s": round(meta["wall_s"], 1),
            **summary, "json": str(path)}
    print(json.dumps(json.loads(to_json(line))))  # one line, NaN -> null
    return summary["exit_code"]


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], check=False, cwd=Path(__file__).resolve().parent, capture_output=True,
                              text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def environment(device: torch.device, cfg: BenchConfig, command: str) -> dict[str, Any]:
    on_cuda = device.type == "cuda"
    status = _git("status", "--porcelain")
    return {
        "device": torch.cuda.get_device_name(device) if on_cuda else "cpu",
        "device_capability": list(torch.cuda.get_device_capability(device)) if on_cuda else None,
        "torch": torch.__version__, "cuda": torch.version.cuda, "triton": _version("triton"),
        "transformers": _version("transformers"),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command, "argv": sys.argv,
        "git_commit": _git("rev-parse", "HEAD"), "git_dirty": bool(status) if status is not None else None,
        # the fast paths' switches (JETRL_PDL, JETRL_GEMM_BACKEND, ...: jetrl/overrides.py) set for this run
        "switches": {k: v for k, v in sorted(os.environ.items())
                     if k.startswith("JETRL_") or k == "PYTORCH_CUDA_ALLOC_CONF"},
        "timing": "CUDA events / CUDA-graph replay" if on_cuda else "CPU perf_counter: MEANINGLESS (smoke)",
        "exact_mode": exact_requested(),  # jetrl/exact.py: every time then is exact mode's
        "hbm_bytes_per_s_for_floors": HBM_BYTES_PER_S,
        "config": dataclasses.asdict(cfg),
    }
