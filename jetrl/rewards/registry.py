"""Reward functions by name, and ``compute_rewards``: the one place rewards are called.

Why a wrapper: a reward function is user code run on model output, so it fails in
data-dependent ways. ``compute_rewards`` turns any exception into a ``RewardError`` that names
the function and the first sample it fails on (found by re-calling it one sample at a time),
with the original exception chained, and checks that it returned one number per completion.
``None`` in a reward list means "not applicable to this sample" (TRL's convention) and becomes
NaN. Signatures follow TRL: ``fn(completions, **columns) -> list[float]``, where each column
is a list aligned with ``completions``, all passed by keyword (``call_reward``). A function without
``**kwargs`` gets only the columns it names, so ``def reward(completions, ground_truth)`` works
whatever else the dataset holds.
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jetrl.rewards.format import format_reward
from jetrl.rewards.math import math_reward
from jetrl.rewards.rg import reasoning_gym_reward

RewardFunc = Callable[..., list[float | None]]

REWARD_FUNCS: dict[str, RewardFunc] = {
    "math": math_reward,
    "format": format_reward,
    "reasoning_gym": reasoning_gym_reward,
}


ANSWER_REWARDS = ("math", "reasoning_gym")  # the registered rewards that score an answer right (1) or wrong


def correctness_func(funcs: str | RewardFunc | Sequence[str | RewardFunc] | Mapping[str, RewardFunc]) -> RewardFunc:
    """The reward that says whether an answer is right -- held-out accuracy and the rollout's ``accuracy`` metric --
    for a task trained on ``funcs``: the first of them that scores answers ('math' or 'reasoning_gym'), else
    'math'. A reasoning-gym task trained on its own scorer is evaluated by it too, not by math equivalence (which
    takes a word and its anagram for equal products of symbols)."""
    names = funcs if isinstance(funcs, Mapping) else [funcs] if isinstance(funcs, str) or callable(funcs) else funcs
    for name in names:
        if isinstance(name, str) and name in ANSWER_REWARDS:
            return REWARD_FUNCS[name]
    return math_reward


def is_correct(reward: float | None) -> bool:
    """Full credit: a reward of 1. reasoning-gym's scorers give partial credit (0.01-0.05 for a wrong answer in the
    right form), which is not a correct answer; None (not applicable) and NaN are not either."""
    return reward is not None and reward >= 1.0


class RewardError(RuntimeError):
    """A reward function raised or returned something other than one number per completion."""


def get_reward_func(name: str) -> RewardFunc:
    """The reward function registered as ``name``, or imported from ``"package.module:function"``."""
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"reward function {name!r} cannot be imported ({e}); use 'package.module:function' "
                             "with the package on PYTHONPATH") from None
        if not callable(fn):
            raise ValueError(f"reward function {name!r} is not callable")
        return fn
    if name not in REWARD_FUNCS:
        raise ValueError(f"unknown reward function {name!r}: choose one of {', '.join(REWARD_FUNCS)}, "
                         "import one as 'package.module:function', or pass a callable fn(completions, **kwargs)")
    return REWARD_FUNCS[name]


def resolve_reward_funcs(funcs: str | RewardFunc | Sequence[str | RewardFunc] | Mapping[str, RewardFunc]
                         ) -> dict[str, RewardFunc]:
    """Names and callables (TRL's ``reward_funcs``) -> ``{name: fn}``, in order."""
    if isinstance(funcs, Mapping):
        return dict(funcs)
    if isinstance(funcs, str) or callable(funcs):
        funcs = [funcs]
    resolved: dict[str, RewardFunc] = {}
    for f in funcs:
        if not isinstance(f, str) and not callable(f):
            raise TypeError(f"reward function {f!r} is neither a name (e.g. 'math', 'module:function') nor a callable")
        name, fn = (f, get_reward_func(f)) if isinstance(f, str) else (getattr(f, "__name__", repr(f)), f)
        if name in resolved:
            raise ValueError(f"reward function {name!r} is given twice")
        resolved[name] = fn
    return resolved


def _column_at(value: Any, i: int, n: int) -> Any:
    return [value[i]] if isinstance(value, (list, tuple)) and len(value) == n else value


def _first_failing_sample(fn: RewardFunc, completions: list, columns: dict[str, Any]) -> int | None:
    n = len(completions)
    for i in range(n):
        try:
            call_reward(fn, [completions[i]], {k: _column_at(v, i, n) for k, v in columns.items()})
        except Exception:  # noqa: BLE001 -- user code: any exception marks the sample
            return i
    return None


def _to_floats(name: str, rewards: Any, n: int) -> list[float]:
    if not isinstance(rewards, Sequence) or isinstance(rewards, str):
        raise RewardError(f"reward function {name!r} returned {type(rewards).__name__}, expected a list of {n} floats")
    if len(rewards) != n:
        raise RewardError(f"reward function {name!r} returned {len(rewards)} rewards for {n} completions")
    out = []
    for i, r in enumerate(rewards):
        try:
            out.append(math.nan if r is None else float(r))
        except (TypeError, ValueError) as e:
            raise RewardError(f"reward function {name!r} returned a non-number at sample {i}: {r!r}") from e
    return out


def call_reward(fn: RewardFunc, completions: list, columns: Mapping[str, Any]) -> Any:
    """``fn`` on ``completions`` with the ``columns`` it takes, as TRL calls it: everything by keyword
    (``completions=``, ``prompts=``, ``completion_ids=``, each dataset column) to a function with a ``completions``
    parameter; otherwise the completions go to its first parameter (``def reward(texts, **kwargs)``).
    Without ``**kwargs`` it gets only the columns it names (``def reward(texts, ground_truth)``). A signature Python
    cannot read gets everything, completions first."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return fn(completions, **columns)
    by_name = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    named = {p.name for p in params if p.kind in by_name}
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    if "completions" in named:
        return fn(**{k: v for k, v in columns.items() if takes_all or k in named}, completions=completions)
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    first = params[0].name if params and params[0].kind in positional else None
    return fn(completions, **{k: v for k, v in columns.items() if (takes_all or k in named) and k != first})


def compute_rewards(funcs: str | RewardFunc | Sequence[str | RewardFunc] | Mapping[str, RewardFunc],
                    completions: list, **columns: Any) -> dict[str, list[float]]:
    """Call every reward function on the batch: ``{name: [reward per completion]}``."""
    n = len(completions)
    for key, value in columns.items():
        if isinstance(value, (list, tuple)) and len(value) != n:
            raise ValueError(f"column {key!r} has {len(value)} values for {n} completions")
    results = {}
    for name, fn in resolve_reward_funcs(funcs).items():
        try:
            rewards = call_reward(fn, completions, columns)
        except Exception as e:
            i = _first_failing_sample(fn, completions, columns)
            where = f"sample {i}" if i is not None else "the batch (no single sample fails alone)"
            raise RewardError(f"reward function {name!r} raised on {where}: {type(e).__name__}: {e}") from e
        results[name] = _to_floats(name, rewards, n)
    return results
