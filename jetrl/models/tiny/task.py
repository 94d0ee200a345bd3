"""The tiny adder's task: the fixed train / held-out split of two-digit addition, and the answer text.

Why the split has its own seed: the held-out problems must not depend on the SFT seed, so RL
can measure any start on problems (and swaps) it never saw.
"""

from __future__ import annotations

from jetrl.data.records import Record
from jetrl.data.tasks import synthetic_split

SPLIT_SEED = 20250  # fixed: the held-out problems do not depend on the SFT seed
NUM_EVAL = 500  # held-out problems reserved (RL evaluates on a prefix of them); the rest is TRAIN


def tiny_task_split(num_eval: int = NUM_EVAL) -> tuple[list[Record], list[Record]]:
    """(train, held-out) addition records, operands 0..99: the split the tiny start was SFT'd on.

    All 5050 distinct problems (a problem and its swap count once) are used: ``5050 - num_eval``
    for training, ``num_eval`` held out. SFT used ``num_eval=NUM_EVAL``. A smaller ``num_eval`` gives
    a prefix of that held-out set (the split is one fixed permutation), so RL may evaluate on
    ``tiny_task_split(200)[1]``; a larger one would hold problems the start was trained on.
    """
    total = 100 * 101 // 2
    return synthetic_split(total - num_eval, num_eval, SPLIT_SEED, ops=("+",), min_operand=0, max_operand=99)


def _operands(record: Record) -> tuple[int, int]:
    text = record["prompt"][-1]["content"]  # "What is a + b?"
    a, _, b = text.removeprefix("What is ").removesuffix("?").partition(" + ")
    return int(a), int(b)


def answer_text(value: int) -> str:
    r"""The demonstration text of an answer: ``\boxed{value}`` (the EOS token follows it)."""
    return "\\boxed{" + str(value) + "}"
