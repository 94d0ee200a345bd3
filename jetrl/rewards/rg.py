"""Reasoning-gym's own scorers as a reward: ``ds.score_answer(answer, entry)`` per task.

Why: every reasoning-gym task ships a scorer that knows its answer type (partial credit for
near misses, decimal tolerance, non-numeric answers such as word puzzles) where the math
reward only knows math. We extract the final answer with the shared convention
(``answer.extract_answer``) and score it against an entry rebuilt from the record columns:
``{"answer": ground_truth, "metadata": metadata}`` (``ground_truth`` None for a task whose scorer
checks an answer against the problem itself, e.g. graph_color). Rewards are in [0, 1], not only
0/1. The ``task`` column picks the scorer. reasoning-gym is imported lazily.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from jetrl.rewards.answer import Completion, completion_text, extract_answer


@functools.cache
def score_fn(task: str) -> Callable[[str | None, dict[str, Any]], float]:
    """reasoning-gym's scorer for ``task`` (cached: building it instantiates the dataset class)."""
    try:
        import reasoning_gym
    except ImportError as e:
        raise ImportError("the reasoning_gym reward needs reasoning-gym: pip install reasoning-gym==0.1.25") from e
    return reasoning_gym.get_score_answer_fn(task)


def reasoning_gym_reward(completions: list[Completion], ground_truth: list[str | None], task: list[str],
                         metadata: list[dict[str, Any] | None] | None = None, **kwargs: Any) -> list[float]:
    """reasoning-gym's score of each completion's final answer, in [0, 1]."""
    metadata = metadata if metadata is not None else [None] * len(completions)
    rewards = []
    for completion, gold, name, meta in zip(completions, ground_truth, task, metadata, strict=True):
        entry = {"question": "", "answer": None if gold is None else str(gold), "metadata": meta or {}}
        rewards.append(float(score_fn(name)(extract_answer(completion_text(completion)), entry)))
    return rewards
