"""Transpose FP8 codes: ``dst = src^T`` for a (R, C) one-byte tensor, tile by tile.

Why: dgrad reads the weight as W^T (K-major for the FP8 tensor cores), and the weight cache derives
it from the cached codes after every optimizer step (jetrl/fp8/weight_cache.py). PyTorch's generic
``copy_`` of a transposed one-byte view reads with a stride of C bytes per element: 0.33 TB/s on the
H200, 42.1 ms per optimizer step for the 36 layers of an 8B model, against 6.5 ms here (0.9-3.0
TB/s; ``bench/time_code_transpose.py``, docs/benchmarks.md section f). Here each program loads a
BLOCK x BLOCK tile coalesced along C, transposes it in registers/shared memory (``tl.trans``) and
stores it coalesced along R. The reference (the spec) is
``src.t().contiguous()``; the result is bit-identical (a permutation of bytes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 64


@triton.jit
def _transpose_kernel(src_ptr, dst_ptr, R, C, BLOCK: tl.constexpr):
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    rows = pid_r * BLOCK + tl.arange(0, BLOCK)
    cols = pid_c * BLOCK + tl.arange(0, BLOCK)
    tile = tl.load(src_ptr + rows[:, None].to(tl.int64) * C + cols[None, :],
                   mask=(rows[:, None] < R) & (cols[None, :] < C))
    tl.store(dst_ptr + cols[:, None].to(tl.int64) * R + rows[None, :], tl.trans(tile),
             mask=(cols[:, None] < C) & (rows[None, :] < R))


def transpose_triton(src: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``src.t().contiguous()`` for a contiguous 2-D one-byte tensor (FP8 codes), written into ``out`` if given."""
    if src.dim() != 2 or src.element_size() != 1 or not src.is_contiguous():
        raise ValueError(f"transpose_triton takes a contiguous 2-D one-byte tensor, got {src.dtype} "
                         f"{tuple(src.shape)} (contiguous={src.is_contiguous()})")
    r, c = src.shape
    if out is None:
        out = torch.empty((c, r), dtype=src.dtype, device=src.device)
    elif out.shape != (c, r) or out.dtype != src.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {src.dtype} tensor of shape {(c, r)}, got {out.dtype} "
                         f"{tuple(out.shape)}")
    if r and c:
        _transpose_kernel[(triton.cdiv(r, BLOCK), triton.cdiv(c, BLOCK))](
            src.view(torch.uint8), out.view(torch.uint8), r, c, BLOCK=BLOCK, num_warps=4)
    return out
