"""One value computed from an input tensor, reused while that same tensor comes back unchanged.

Why: sibling layers read the same activation -- q/k/v of one attention, gate/up of one MLP. Its
FP8 quantization (linear.py: in training both layouts, of which X^T is saved for the wgrads) and,
on CUDA, the siblings' stacked GEMM or, in training, their one autograd Function (projection_group.py)
need computing once per activation, not once per sibling.

A hit needs all of:
* the same tensor *object*, held by a weak reference, so a freed tensor never matches, even when
  a new one reuses its memory;
* the same version counter, so nothing changed it in place since;
* the same caller key (the quantization spec);
* the same CUDA-graph capture state, so a graph never reads a value computed outside it.

``torch.inference_mode`` tensors have no version counter, so they are never reused: the value is
recomputed on every call. One memo per thread (``threading.local``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch


class InputMemo(threading.local):
    """The last ``make()`` result for an input tensor (module docstring)."""

    def __init__(self) -> None:
        self._ref: weakref.ref | None = None
        self._key: tuple | None = None
        self._value: Any = None

    def get(self, x: torch.Tensor, key: Any, make: Callable[[], Any]) -> Any:
        if x.is_inference():
            return make()
        full_key = _full_key(x, key)
        if self._ref is None or self._ref() is not x or self._key != full_key:
            self._value = make()
            self._ref, self._key = weakref.ref(x), full_key
        return self._value

    def put(self, x: torch.Tensor, key: Any, value: Any) -> None:
        """Hold ``value`` as what ``get(x, key, ...)`` would compute now (ignored for inference tensors)."""
        if not x.is_inference():
            self._value = value
            self._ref, self._key = weakref.ref(x), _full_key(x, key)

    def clear(self) -> None:
        """Drop the held value (and its memory) now."""
        self._ref = self._key = self._value = None

    def __reduce__(self):
        """A copy (``copy.deepcopy`` of a converted model: the trainer's KL reference model) or a pickle starts empty:
        the held value belongs to this memo's input (and a ``threading.local`` cannot be pickled as it is)."""
        return type(self), ()


def _full_key(x: torch.Tensor, key: Any) -> tuple:
    return x._version, key, x.is_cuda and torch.cuda.is_current_stream_capturing()
