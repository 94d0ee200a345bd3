"""A scoped, process-wide override of a backend choice: the one mechanism behind
``jetrl.fp8.override_backend``, ``jetrl.engine.decode_attention.use_decode_attention_backend``
and ``jetrl.models.fused.use_fused_ops``.

Why: each fast path resolves its default once (per device, from the hardware and an environment
variable); tests and benchmarks must force another choice for a block of code and get the
previous one back afterwards, also when blocks nest or raise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


class ScopedOverride:
    """``with override(choice):`` forces ``choice`` inside the block; ``override.value`` is the
    innermost forced choice, or None outside every block."""

    def __init__(self, what: str, choices: tuple[Any, ...]) -> None:
        self.what, self.choices = what, choices
        self._stack: list[Any] = []

    @property
    def value(self) -> Any:
        return self._stack[-1] if self._stack else None

    @contextlib.contextmanager
    def __call__(self, choice: Any) -> Iterator[None]:
        if choice not in self.choices:
            raise ValueError(f"unknown {self.what} {choice!r}; use one of {self.choices}")
        self._stack.append(choice)
        try:
            yield
        finally:
            self._stack.pop()
