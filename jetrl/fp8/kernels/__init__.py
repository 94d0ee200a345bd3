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


def capability(device: torch.device) -> tuple[int, int]:
    """The CUDA device's compute capability, looked up once per device (kernels ask at every launch)."""
    return _capability(torch.cuda.current_device() if device.index is None else device.index)


@cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def sm_count(device: torch.device) -> int:
    """The CUDA device's number of SMs, looked up once per device (launch rules size grids by it)."""
    return _sm_count(torch.cuda.current_device() if device.index is None else device.index)


@cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@cache
def has_triton() -> bool:
    """True if Triton can be imported (it is not required on CPU)."""
    return importlib.util.find_spec("triton") is not None
