r"""Final-answer extraction, shared by the math, format and reasoning-gym rewards.

Why one extractor: a reward that reads the answer one way and a format reward that checks
another way teach the policy two conventions. The project convention is that a completion
states its final answer as ``\boxed{...}`` (what math-verify, Qwen-Math and most GRPO math
recipes use). ``extract_answer`` reads, first hit wins:

  1. the content of the *last* ``\boxed{...}``, braces balanced (``\boxed{\frac{1}{2}}``);
     a ``\boxed{`` left unclosed by truncation is ignored;
  2. the rest of the line after the *last* ``####`` (GSM8K's solution convention);
  3. optionally, the last plain number in the text (``-3``, ``1,000``, ``2.5``, ``3/4``):
     lm-eval's "flexible extract". It lets a tiny model trained from scratch that answers
     ``81`` (no LaTeX) earn the math reward; the format reward is what pushes ``\boxed{}``.

The result is cleaned (surrounding ``$`` and whitespace, a trailing ``.``) and ``None`` means
"no answer". Completions may be strings or TRL conversational lists of messages; the text of
the last message is used.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

_BOXED = re.compile(r"\\boxed\s*\{")
# A thousands-grouped or plain integer, optional decimals or a /denominator.
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?")

Completion = str | Sequence[Mapping[str, str]]


def completion_text(completion: Completion) -> str:
    """The text of a completion: the string itself, or the content of the last message."""
    if isinstance(completion, str):
        return completion
    if len(completion) == 0:
        return ""
    return str(completion[-1].get("content", ""))


def find_boxed(text: str) -> list[str]:
    r"""Contents of every closed ``\boxed{...}`` in ``text``, in order (nested braces kept)."""
    found = []
    for m in _BOXED.finditer(text):
        depth, start = 1, m.end()
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                found.append(text[start:i])
                break
    return found


def _clean(answer: str) -> str | None:
    answer = answer.strip().strip("$").strip()
    answer = answer.removesuffix(".").strip()
    return answer or None


def extract_answer(text: str, *, number_fallback: bool = True) -> str | None:
    """The final answer of ``text`` by the rules in the module docstring, or None."""
    boxed = find_boxed(text)
    if boxed:
        return _clean(boxed[-1])
    if "####" in text:
        return _clean(text.rsplit("####", 1)[1].split("\n", 1)[0])
    if number_fallback:
        numbers = _NUMBER.findall(text)
        if numbers:
            return numbers[-1]
    return None
