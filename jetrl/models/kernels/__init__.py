"""Triton kernels of model ops: fused RMSNorm, RoPE and SwiGLU (fused_triton.py) and their backward
(fused_backward_triton.py). Each has a PyTorch reference in :mod:`jetrl.models.fused` that is its
spec (for a backward: autograd through the reference). Triton is imported lazily, by the kernel module
about to run: jetrl imports and runs without it (the references take over;
``jetrl.fp8.kernels.has_triton`` tells).
"""

from __future__ import annotations

import torch


def aligned_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x`` contiguous at a 16-byte-aligned address, copied only where it is not. The exact-mode kernels take every
    operand this way, so that every call compiles to (and runs) the one binary specialized for aligned, contiguous
    operands (models/kernels/exact_attention_triton.py says why one binary)."""
    if x.is_contiguous() and x.data_ptr() % 16 == 0:
        return x
    return x.clone(memory_format=torch.contiguous_format)
