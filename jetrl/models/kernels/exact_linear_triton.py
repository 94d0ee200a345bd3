"""Batch-invariant BF16 linear layer in Triton: y = x W^T (+ b) with one tile shape for every M.

Spec: ``F.linear`` in fp32 (:func:`jetrl.models.exact_ops.exact_linear_reference`). Exact mode
(jetrl/exact.py) sends every high-precision linear layer here -- the lm_head in every recipe, and the
projections of the BF16 recipes -- in the trainer's forward and in the rollout alike.

Why: cuBLAS picks its kernel by the problem shape (tile, split-K, stream-K), so the 256-row GEMM of a
decode step and the 18,000-row GEMM of a training micro-batch sum a row's products in different orders
and round differently. Here a (BLOCK_M, BLOCK_N) output tile's K walk, in steps of BLOCK_K, is cut into ``S``
runs (a function of K only: split_k.k_splits), each a chain of tensor-core dots accumulated in fp32 from zero
(``tl.dot(a, b, acc)``); the runs are added in order, the bias in fp32, then one rounding to the output dtype::

    acc_s = 0;  for k0 in run s:  acc_s = dot(x[rows, k0:k0+BK], W[cols, k0:k0+BK]^T, acc_s)
    y     = rnd(0 + acc_0 + ... + acc_{S-1} + b)

Where a layer's output tiles would fill at most half the SMs (a decode step) each run is its own program and the
last to finish adds the partials; elsewhere one program walks all runs: the same additions (split_k.merge_splits).

``TILES`` is a constant of this file, so a row's sum runs in one order whatever M is; the products accumulate
inside the dot, the kernel is compiled without FMA contraction, and one binary serves every M and both ways of
running a tile (no argument is specialized on its value), as in the exact attention, whose docstring says why. Under
``TRITON_INTERPRET=1`` (the CPU tests) the dot is taken in IEEE fp32 on the exactly upcast operands and the
final rounding done on the bits (the interpreter's bf16 dot and cast are not the GPU's: rounding.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetrl.fp8.kernels.rounding import INTERPRET, round_to
from jetrl.fp8.kernels.split_k import k_splits, merge_splits, split_buffers
from jetrl.models.kernels import aligned_contiguous

# fixed: part of the arithmetic (bench/sweep_exact_tiles.py on the H200; every candidate batch-invariant). 128 x 128
# tiles (run CQ: the 9216-row lm_head 44 -> 25 ms and a Qwen3-8B layer's four GEMMs 11.5 -> 5.9 ms against 64 x 128);
# 4 K runs (run CU: the layer's four GEMMs under CUDA graphs at 64 rows 321 -> 193 µs, at 256 rows 356 -> 274, at
# 9216 rows 7.5 -> 7.6 ms), with 8 warps and 4 stages (4 warps spill with the runs' second accumulator)
TILES = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "SPLITS": 4, "num_warps": 8, "num_stages": 4}


# M and the program count stay runtime values (one binary for every batch size and both ways of running a tile:
# Triton otherwise compiles one per value class, == 1 or a multiple of 16, and binaries may round differently); N and
# K are compile-time (a layer's shape), and x, w, b and out contiguous and 16-byte aligned in every call (the wrapper
# makes them so), so the loads vectorize.
#
# ``zero`` is a runtime 0.0 that each K run's accumulator starts from: with a literal zero, Triton's combine pass
# rewrites ``total + dot(a, b, 0)`` (a one-step run in one program) into ``dot(a, b, total)``, which rounds
# differently from the split path's separate add (measured on the H200, K = 256: 196 of 300 calls differed).
@triton.jit(do_not_specialize=("M", "programs_k"))
def _exact_linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, work_ptr, count_ptr, M, programs_k, zero, N: tl.constexpr,
                         K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, SPLITS: tl.constexpr, STEPS_PER_SPLIT: tl.constexpr,
                         EMULATE: tl.constexpr):
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    offs_k = tl.arange(0, BLOCK_K)
    runs = SPLITS // programs_k  # this program's K runs: all of them, or its own one (split_k.merge_splits)
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    s, end = pid_k * runs, (pid_k + 1) * runs
    while s < end:  # a while loop: the interpreter's range() cannot take a runtime bound
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32) + zero  # not a literal zero: see above
        for i in range(STEPS_PER_SPLIT):  # a compile-time trip count (one binary per K): the loads are pipelined
            kk = (s * STEPS_PER_SPLIT + i) * BLOCK_K + offs_k
            k_ok = kk < K  # also false for a whole step past K (the last run may be short)
            a = tl.load(x_ptr + rows[:, None] * K + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_ptr + cols[:, None] * K + kk[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if EMULATE:
                acc += tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
            elif a.dtype == tl.float32:  # an fp32 model: IEEE fp32 products, not TF32
                acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee", out_dtype=tl.float32)
            else:
                acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.float32)
        total += acc
        s += 1
    tile_mask = row_ok[:, None] & col_ok[None, :]
    work = work_ptr + rows[:, None] * N + cols[None, :]
    total, last = merge_splits(total, work, tile_mask, count_ptr + pid_m * tl.num_programs(0) + pid_n, pid_k, M * N,
                               programs_k)
    if last:
        if HAS_BIAS:
            total += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], round_to(total, out_ptr.dtype.element_ty, EMULATE),
                 mask=tile_mask)


def exact_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        programs_k: int | None = None) -> torch.Tensor:
    """(M, N) = x (M, K) . weight (N, K)^T (+ bias (N,)), in x's dtype (operands copied where not contiguous).
    ``programs_k``: split_k.split_buffers (speed only)."""
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k, (x.shape, weight.shape)
    x, weight = aligned_contiguous(x), aligned_contiguous(weight)
    bias = None if bias is None else aligned_contiguous(bias)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    splits, per_split = k_splits(triton.cdiv(k, TILES["BLOCK_K"]), TILES["SPLITS"])
    tiles = (triton.cdiv(n, TILES["BLOCK_N"]), triton.cdiv(m, TILES["BLOCK_M"]))
    programs_k, work, counters = split_buffers(tiles[0] * tiles[1], splits, m, n, x.device, programs_k)
    _exact_linear_kernel[(*tiles, programs_k)](
        x, weight, x if bias is None else bias, out, work, counters, m, programs_k, 0.0, n, k,
        HAS_BIAS=bias is not None, BLOCK_M=TILES["BLOCK_M"], BLOCK_N=TILES["BLOCK_N"], BLOCK_K=TILES["BLOCK_K"],
        SPLITS=splits, STEPS_PER_SPLIT=per_split, EMULATE=INTERPRET, num_warps=TILES["num_warps"],
        num_stages=TILES["num_stages"], enable_fp_fusion=False,
    )
    return out
