r"""Format reward: 1.0 when a completion states exactly one final answer as ``\boxed{...}``.

Why ``\boxed{}`` and not ``<answer>...</answer>``: it is the convention the math reward reads
first (``answer.py``), so the two rewards never pull apart, and instruct models already emit it
for math. "Exactly one" means one closed ``\boxed{`` with non-empty content: zero, several
(hedging) or an empty/unclosed box score 0.0. Text around the box is free (reasoning before it
is expected). It is a shaping reward: combine it with the math reward at a small weight.
"""

from __future__ import annotations

from typing import Any

from jetrl.rewards.answer import Completion, completion_text, find_boxed


def has_one_boxed_answer(text: str) -> bool:
    r"""Exactly one closed ``\boxed{...}``, with non-blank content, and no unclosed one."""
    boxed = find_boxed(text)
    return len(boxed) == 1 and text.count("\\boxed") == 1 and bool(boxed[0].strip())


def format_reward(completions: list[Completion], **kwargs: Any) -> list[float]:
    r"""1.0 per completion with exactly one non-empty ``\boxed{...}``, else 0.0."""
    return [float(has_one_boxed_answer(completion_text(c))) for c in completions]
