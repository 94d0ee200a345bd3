"""Triton: the decode attention's program order, longest row first, by counting instead of sorting.

Spec: ``torch.argsort(lengths, descending=True, stable=True)`` (:func:`jetrl.engine.decode_attention.longest_first`).

Why: the engine orders the rows once per decode step (the decode attention kernel runs them longest
first, docs/benchmarks.md section (d)). ``torch.argsort`` of 256 int64 lengths is a radix sort of
26.8 µs on the H200 -- more than a decode layer's norms. The rows are few (the engine's slots), so a
stable rank is cheap to count directly:

    rank(i) = #{j : len_j > len_i} + #{j < i : len_j = len_i},      order[rank(i)] = i

which is exactly the stable descending argsort (ranks are a permutation of 0..B-1). Each program
ranks BLOCK rows against all B, CHUNK at a time: B^2 integer compares, no atomics, one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _longest_first_kernel(len_ptr, order_ptr, n, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    i_ok = i < n
    li = tl.load(len_ptr + i, mask=i_ok, other=0)
    rank = tl.zeros([BLOCK], dtype=tl.int32)
    start = 0
    while start < n:  # a while loop: the interpreter's range() cannot take a runtime bound
        j = start + tl.arange(0, CHUNK)
        lj = tl.load(len_ptr + j, mask=j < n, other=0)
        ahead = (lj[None, :] > li[:, None]) | ((lj[None, :] == li[:, None]) & (j[None, :] < i[:, None]))
        rank += tl.sum((ahead & (j < n)[None, :]).to(tl.int32), axis=1)
        start += CHUNK
    tl.store(order_ptr + rank, i.to(tl.int64), mask=i_ok)


def longest_first_triton(lengths: torch.Tensor) -> torch.Tensor:
    """Same result as ``torch.argsort(lengths, descending=True, stable=True)`` for a 1-D integer tensor."""
    assert lengths.dim() == 1 and not lengths.is_floating_point(), (lengths.shape, lengths.dtype)
    lengths = lengths.contiguous()  # the kernel reads element i at offset i
    n = lengths.shape[0]
    order = torch.empty(n, dtype=torch.int64, device=lengths.device)
    if n:
        block = 64
        _longest_first_kernel[(triton.cdiv(n, block),)](lengths, order, n, BLOCK=block, CHUNK=64, num_warps=4)
    return order
