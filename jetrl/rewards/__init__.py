r"""Reward functions in TRL's signature ``fn(completions, **columns) -> list[float]``.

``math`` (math-verify answer equality), ``format`` (exactly one ``\boxed{}``), and
``reasoning_gym`` (the task's own scorer); ``compute_rewards`` calls them with errors that
name the failing function and sample.
"""

from jetrl.rewards.answer import completion_text, extract_answer, find_boxed
from jetrl.rewards.format import format_reward
from jetrl.rewards.math import is_equivalent, math_reward
from jetrl.rewards.registry import (
    REWARD_FUNCS,
    RewardError,
    RewardFunc,
    compute_rewards,
    correctness_func,
    get_reward_func,
    is_correct,
    resolve_reward_funcs,
)
from jetrl.rewards.rg import reasoning_gym_reward

__all__ = [
    "REWARD_FUNCS",
    "RewardError",
    "RewardFunc",
    "completion_text",
    "compute_rewards",
    "correctness_func",
    "extract_answer",
    "find_boxed",
    "format_reward",
    "get_reward_func",
    "is_correct",
    "is_equivalent",
    "math_reward",
    "reasoning_gym_reward",
    "resolve_reward_funcs",
]
