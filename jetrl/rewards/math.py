r"""Math answer reward: 1.0 when the completion's final answer equals the gold answer.

Why math-verify: string equality fails on ``0.5`` vs ``\frac{1}{2}``, ``1,000`` vs ``1000``
or ``x = 3`` vs ``3``. math-verify parses both sides to sympy and compares them (numbers to
6 decimals, sets, intervals, equations). We extract the final answer ourselves first
(``answer.extract_answer``: last ``\boxed{}``, else after ``####``, else the last number) and
hand math-verify only that short string, wrapped as ``\boxed{...}`` so it is read as LaTeX:
this bounds parsing cost and avoids math-verify's "any match" reading several answers as a
set. The gold answer goes through the same extraction without the number fallback (a gold
``"... #### 72"`` solution gives ``72``; a bare ``"72"`` is used whole). When either side does
not parse, normalized strings are compared instead.

Threads: math-verify bounds parse/verify time with ``signal.alarm``, which only works in the
main thread and raises elsewhere. In the main thread we keep its 5 s timeouts; in any other
thread we pass ``parsing_timeout=None``/``timeout_seconds=None`` (no timeout there).
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from jetrl.rewards.answer import Completion, clean_answer, completion_text, extract_answer

TIMEOUT_S = 5  # math-verify's parse/verify timeout in the main thread
GOLD_COLUMNS = ("ground_truth", "answer", "solution")  # per sample, the first of them that is not None


@functools.cache
def _math_verify():
    try:
        import math_verify
    except ImportError as e:
        raise ImportError("the math reward needs math-verify: pip install math-verify==0.9.0") from e
    return math_verify


def _timeout() -> int | None:
    return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


@functools.lru_cache(maxsize=4096)
def _parse(answer: str, timeout: int | None) -> tuple:
    # Cached: the G completions of a GRPO group share one gold answer.
    return tuple(_math_verify().parse("\\boxed{" + answer + "}", parsing_timeout=timeout))


def _normalize(answer: str) -> str:
    return "".join(answer.split()).replace(",", "").lower()


def is_equivalent(pred: str, gold: str) -> bool:
    """Whether two extracted answers are mathematically equal (gold first: verify is asymmetric)."""
    timeout = _timeout()
    gold_parsed, pred_parsed = _parse(gold, timeout), _parse(pred, timeout)
    if gold_parsed and pred_parsed:
        return bool(_math_verify().verify(list(gold_parsed), list(pred_parsed), timeout_seconds=timeout))
    return _normalize(pred) == _normalize(gold)


def gold_answer(gold: Any) -> str:
    """The answer inside a gold string: its boxed/#### answer if it has one, else all of it, cleaned as a
    prediction is (a gold ``"72."`` is ``72``)."""
    text = str(gold)
    return extract_answer(text, number_fallback=False) or clean_answer(text) or text.strip()


def gold_column(kwargs: dict[str, Any], reward_name: str, n: int) -> list:
    """Each of ``n`` samples' gold answer among the dataset columns TRL passes as kwargs: the first of
    GOLD_COLUMNS that is not None *for that sample* (a ``ground_truth`` column built from records that hold an
    ``answer`` instead is all None). A sample with none is an error, never the string "None"."""
    columns = [(key, kwargs[key]) for key in GOLD_COLUMNS if kwargs.get(key) is not None]
    if not columns:
        raise ValueError(f"the {reward_name} reward needs a gold-answer column: one of {', '.join(GOLD_COLUMNS)}; "
                         f"got columns {sorted(kwargs) or 'none'}")
    golds = []
    for i in range(n):
        gold = next((col[i] for _, col in columns if col[i] is not None), None)
        if gold is None:
            raise ValueError(f"the {reward_name} reward: sample {i} has no gold answer (its "
                             f"{', '.join(key for key, _ in columns)} are None); give every record one")
        golds.append(gold)
    return golds


def math_reward(completions: list[Completion], **kwargs: Any) -> list[float]:
    """1.0 if the final answer of each completion equals its gold answer, else 0.0 (no answer: 0.0)."""
    golds = gold_column(kwargs, "math", len(completions))
    rewards = []
    for completion, gold in zip(completions, golds, strict=True):
        pred = extract_answer(completion_text(completion))
        rewards.append(float(pred is not None and is_equivalent(pred, gold_answer(gold))))
    return rewards
