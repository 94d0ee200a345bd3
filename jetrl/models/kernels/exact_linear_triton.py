"""Batch-invariant BF16 linear layer in Triton: y = x W^T (+ b) with one tile shape for every M.

Spec: ``F.linear`` in fp32 (:func:`jetrl.models.exact_ops.exact_linear_reference`). Exact mode
(jetrl/exact.py) sends every high-precision linear layer here -- the lm_head in every recipe, and the
projections of the BF16 recipes -- in the trainer's forward and in the rollout alike.

Why: cuBLAS picks its kernel by the problem shape (tile, split-K, stream-K), so the 256-row GEMM of a
decode step and the 18,000-row GEMM of a training micro-batch sum a row's products in different orders
and round differently. Here every output tile runs the same program: its (BLOCK_M, BLOCK_N) tile walks K
from 0 in steps of BLOCK_K, each step one tensor-core dot accumulated in fp32 (``tl.dot(a, b, acc)``), the
bias added in fp32 at the end, then one rounding to the output dtype::

    acc = 0;  for k0 in 0, BK, 2 BK, ...:  acc = dot(x[rows, k0:k0+BK], W[cols, k0:k0+BK]^T, acc)
    y   = rnd(acc + b)

``TILES`` is a constant of this file, so a row's sum runs in one order whatever M is; the products accumulate
inside the dot, the kernel is compiled without FMA contraction, and one binary serves every M (no argument is
specialized on its value or alignment), as in the exact attention, whose docstring says why. Under
``TRITON_INTERPRET=1`` (the CPU tests) the dot is taken in IEEE fp32 on the exactly upcast operands and the
final rounding done on the bits (the interpreter's bf16 dot and cast are not the GPU's: rounding.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetrl.fp8.kernels.rounding import INTERPRET, round_to
from jetrl.models.kernels import aligned_contiguous

# fixed: part of the arithmetic. 128 x 128 tiles (bench/sweep_exact_tiles.py on the H200, run CQ; every candidate
# batch-invariant): the 9216-row lm_head 44 -> 25 ms and a Qwen3-8B layer's four GEMMs 11.5 -> 5.9 ms against 64 x 128,
# the 256-row lm_head 1.23 -> 0.70 ms
TILES = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}


# M stays a runtime value (one binary for every batch size: Triton otherwise compiles one per value class, == 1 or
# a multiple of 16, and binaries may round differently); N and K are compile-time (a layer's shape), and x, w, b and
# out contiguous and 16-byte aligned in every call (the wrapper makes them so), so the loads vectorize.
@triton.jit(do_not_specialize=("M",))
def _exact_linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N: tl.constexpr, K: tl.constexpr,
                         HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         K_TILES: tl.constexpr, EMULATE: tl.constexpr):
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(K_TILES):  # a compile-time trip count (one binary per K): the loads are software-pipelined
        kk = i * BLOCK_K + offs_k
        k_ok = kk < K
        a = tl.load(x_ptr + rows[:, None] * K + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + cols[:, None] * K + kk[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if EMULATE:
            acc += tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
        elif a.dtype == tl.float32:  # an fp32 model: IEEE fp32 products, not TF32
            acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee", out_dtype=tl.float32)
        else:
            acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], round_to(acc, out_ptr.dtype.element_ty, EMULATE),
             mask=row_ok[:, None] & col_ok[None, :])


def exact_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """(M, N) = x (M, K) . weight (N, K)^T (+ bias (N,)), in x's dtype (operands copied where not contiguous)."""
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k, (x.shape, weight.shape)
    x, weight = aligned_contiguous(x), aligned_contiguous(weight)
    bias = None if bias is None else aligned_contiguous(bias)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    grid = (triton.cdiv(n, TILES["BLOCK_N"]), triton.cdiv(m, TILES["BLOCK_M"]))
    _exact_linear_kernel[grid](
        x, weight, x if bias is None else bias, out, m, n, k,
        HAS_BIAS=bias is not None, BLOCK_M=TILES["BLOCK_M"], BLOCK_N=TILES["BLOCK_N"], BLOCK_K=TILES["BLOCK_K"],
        K_TILES=triton.cdiv(k, TILES["BLOCK_K"]), EMULATE=INTERPRET, num_warps=TILES["num_warps"],
        num_stages=TILES["num_stages"], enable_fp_fusion=False,
    )
    return out
