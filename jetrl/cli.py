"""``jetrl`` command line: ``train`` (and, as later issues land, generate | eval | bench | export).

``main(argv)`` returns an exit code so tests call it with a list; errors a user can fix
are printed as one line, never as a traceback.
"""

from __future__ import annotations

import argparse
import sys

from jetrl.fp8.recipe import RECIPE_NAMES


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jetrl", description="On-policy FP8 RL for LLMs (Jet-RL).")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run the main job (today: the FP8-core demo)")
    train.add_argument("--recipe", default="jet", choices=RECIPE_NAMES, help="precision recipe")
    train.add_argument("--steps", type=int, default=150, help="optimizer steps")
    train.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "train":
            if args.steps < 1:
                raise ValueError(f"--steps must be >= 1, got {args.steps}")
            from jetrl.demo import main as demo_main

            return demo_main(args.recipe, steps=args.steps, seed=args.seed)
    except (ValueError, TypeError) as err:
        print(f"jetrl {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
