"""Triton kernels. Each has a PyTorch reference with the same signature that is its spec.

Triton is imported lazily: CPU wheels of torch ship without it, and jetrl must import and
run there (the references take over).
"""

from __future__ import annotations

import importlib.util
from functools import cache


@cache
def has_triton() -> bool:
    """True if Triton can be imported (it is not required on CPU)."""
    return importlib.util.find_spec("triton") is not None
