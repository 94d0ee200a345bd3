"""Triton kernels. Each has a PyTorch reference with the same signature that is its spec.

Triton is imported lazily: CPU wheels of torch ship without it, and jetrl must import and
run there (the references take over).
"""

from __future__ import annotations

import importlib.util
from functools import cache

import torch

# the float dtypes the Triton kernels read and write (bf16, fp16, fp32); other dtypes take the references
KERNEL_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@cache
def has_triton() -> bool:
    """True if Triton can be imported (it is not required on CPU)."""
    return importlib.util.find_spec("triton") is not None
