r"""Final-answer extraction, shared by the math, format and reasoning-gym rewards.

Why one extractor: a reward that reads the answer one way and a format reward that checks
another way teach the policy two conventions. The project convention is that a completion
states its final answer as ``\boxed{...}`` (what math-verify, Qwen-Math and most GRPO math
recipes use). ``extract_answer`` reads, first hit wins:

  1. the content of the *last* ``\boxed{...}``, braces balanced (``\boxed{\frac{1}{2}}``);
     a ``\boxed{`` left unclosed by truncation is ignored, and so is the text after it;
  2. the rest of the line after the *last* ``####`` (GSM8K's solution convention), if it holds a
     digit: a markdown heading (``#### Final Answer``) is not an answer;
  3. optionally, the last number in the text (``-3``, ``1,000``, ``2.5``, ``.5``, ``3/4``, ``2^{10}``,
     or a LaTeX ``\frac{3}{4}`` as a whole): lm-eval's "flexible extract". It lets a tiny model trained
     from scratch that answers ``81`` (no LaTeX) earn the math reward; the format reward is what
     pushes ``\boxed{}``. A Unicode minus (U+2212) reads as ``-``.

The result is cleaned (surrounding ``$`` and whitespace; a trailing ``.`` after a number or a
one-word answer, not after a sentence; thin spaces between digit groups, ``1\,000``) and ``None``
means "no answer". Completions may be strings or TRL conversational lists of messages; the text of
the last message is used.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

_BOXED = re.compile(r"\\boxed\s*\{")
# A LaTeX fraction as a whole, else a thousands-grouped or plain integer with optional decimals (or bare
# decimals, ``.5``), an optional /denominator and an optional power (``2^{10}`` is one number, not 10).
_NUMBER = re.compile(r"-?\\[dt]?frac\{[^{}]*\}\{[^{}]*\}"
                     r"|-?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)(?:/\d+)?(?:\^(?:\{-?\d+\}|-?\d+))?")
# Spacing between digit groups of one number: 1\,000, 1~000, 1 000 (math-verify reads "1\,000" as 1 * 0).
_GROUP_SPACE = re.compile(r"(?<=\d)(?:\\[,;:!]|\\ |~|\s)+(?=\d{3}(?!\d))")

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


def clean_answer(answer: str) -> str | None:
    answer = _GROUP_SPACE.sub("", answer.strip().strip("$").strip())
    if answer.endswith(".") and (not any(c.isspace() for c in answer) or answer[-2:-1].isdigit()):
        answer = answer[:-1].strip()  # "72." or "A.", not the period that ends a sentence answer
    return answer or None


def extract_answer(text: str, *, number_fallback: bool = True) -> str | None:
    """The final answer of ``text`` by the rules in the module docstring, or None."""
    boxed = find_boxed(text)
    if boxed:
        return clean_answer(boxed[-1])
    opened = list(_BOXED.finditer(text))
    if opened:  # no \boxed{ closes: truncated inside the answer, whose digits are not the answer
        text = text[: opened[0].start()]
    if "####" in text:
        line = text.rsplit("####", 1)[1].split("\n", 1)[0]
        if any(c.isdigit() for c in line):
            return clean_answer(line)
    if number_fallback:
        numbers = _NUMBER.findall(text.replace("\u2212", "-"))
        if numbers:
            return clean_answer(numbers[-1])
    return None
