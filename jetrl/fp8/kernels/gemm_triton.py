"""Small-M (decode) W8A8 block-FP8 GEMM in Triton; its spec is :func:`jetrl.fp8.gemm.gemm_emulated`.

Why: at decode sizes (a few to 64 rows against an 8B layer's N x K weight; the dispatcher in
gemm.py sends M <= 16 here for all but small weights, and up to 64 rows where K is long:
``choose_backend``) the GEMM is bound by reading the weight, N*K bytes of FP8 codes. cuBLAS's
block-scaled path carries a fixed cost of about 15 us per call (design.md §3: slower than BF16 on
4096x4096 at M = 16), and a plain tile-per-output kernel leaves most of the 132 SMs idle when N / BLOCK_N is small. This
kernel splits K as well, so ``num_n_blocks * split_k`` programs stream disjoint slices of
the weight at full bandwidth.

Math, for a[M, K] in 1x128 groups (scales sa[M, K/128]) and b[N, K] in 128x128 blocks
(scales sb[N/128, K/128]):

    out[m, n] = sum_g  sa[m, g] * sb[n // 128, g] * sum_{k in group g} a[m, k] * b[n, k]

Each program owns a (BLOCK_M, BLOCK_N) output tile and the K-groups
``[pid_k * G, (pid_k + 1) * G)``; per group it runs one FP8 tensor-core dot (exact products,
fp32 accumulation), scales the partial sum and adds it to an fp32 accumulator. With
``split_k > 1`` the programs write fp32 partial sums to a (split_k, M, N) workspace and the
last split to finish a tile (an atomic arrival counter, split_k.py) sums the partials in split order and
writes the output: one launch, and no atomic *accumulation*, so the result is deterministic
run to run. The counters are one fixed buffer per device that the kernel resets itself (no
memset per call, CUDA-graph safe); split-K calls must therefore not overlap on two streams. The
tile configuration is a function of the shape only (:func:`small_m_config`), never of timings,
so the same shape always takes the same summation order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from jetrl.fp8.kernels.split_k import MAX_TILES, store_tile, tile_counters


@dataclass(frozen=True)
class SmallMConfig:
    block_m: int
    block_n: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4


def small_m_config(m: int, n: int, k: int) -> SmallMConfig:
    """The tile configuration for an (m, n, k) GEMM: a pure function of the shape.

    From a sweep on an H200 (BLOCK_N in {64, 128}, split_k in {1, 2, 4, 8}, 3-4 stages, 4-8
    warps) over the decode GEMMs of an 8B layer at M in {1, 16, 32, 64}: BLOCK_N = 64 and 4
    warps won in 15 of 16 cases; wide layers (N >= 16384: gate_up) have enough tiles without a
    split, long K (down, K = 12288) wants 8 splits, the rest 4.
    """
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    if n >= 16384:
        return SmallMConfig(block_m, 64, split_k=1, num_warps=4, num_stages=4)
    return SmallMConfig(block_m, 64, split_k=8 if k >= 8192 else 4, num_warps=4, num_stages=3)


@triton.jit
def scaled_group_product(a_ptr, sa_ptr, b_ptr, sb_ptr, rows, cols, row_ok, col_ok, offs_k, g, K, stride_am, stride_bn,
                         stride_sam, stride_sak, stride_sbn):
    """K-group ``g``'s term of the module docstring's sum for a (rows, cols) tile: one FP8 tensor-core dot (exact
    products, fp32 accumulation) scaled by ``sa[rows, g] * sb[cols // 128, g]``. A group past K (the last split may be
    short) gives 0. Shared with exact mode's kernel (gemm_exact_triton.py)."""
    k = g * 128 + offs_k
    k_ok = k < K
    a = tl.load(a_ptr + rows[:, None] * stride_am + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    b = tl.load(b_ptr + cols[:, None] * stride_bn + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
    group_ok = g * 128 < K
    sa = tl.load(sa_ptr + rows * stride_sam + g * stride_sak, mask=row_ok & group_ok, other=0.0)
    sb = tl.load(sb_ptr + (cols // 128) * stride_sbn + g, mask=col_ok & group_ok, other=0.0)
    return tl.dot(a, tl.trans(b), out_dtype=tl.float32) * sa[:, None] * sb[None, :]


@triton.jit
def _gemm_small_m_kernel(
    a_ptr, sa_ptr, b_ptr, sb_ptr, out_ptr, work_ptr, count_ptr,
    M, N, K, stride_am, stride_bn, stride_sam, stride_sak, stride_sbn, stride_om,
    GROUPS_PER_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, 128)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(GROUPS_PER_SPLIT):
        acc += scaled_group_product(a_ptr, sa_ptr, b_ptr, sb_ptr, rows, cols, row_ok, col_ok, offs_k,
                                    pid_k * GROUPS_PER_SPLIT + i, K, stride_am, stride_bn, stride_sam, stride_sak,
                                    stride_sbn)
    tile_id = pid_m * tl.num_programs(0) + pid_n
    out = out_ptr + rows[:, None] * stride_om + cols[None, :]
    work = work_ptr + rows[:, None] * N + cols[None, :]
    store_tile(acc, out, work, row_ok[:, None] & col_ok[None, :], count_ptr + tile_id, pid_k, M * N, SPLIT_K)


def gemm_small_m(
    a_codes: torch.Tensor, a_scales: torch.Tensor, b_codes: torch.Tensor, b_scales: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16, config: SmallMConfig | None = None,
) -> torch.Tensor:
    """out[M, N] = deq(a) @ deq(b)^T for a (M, K) 1x128 and b (N, K) 128x128 (row-major codes).

    One launch (the split-K sum is done in-kernel by the last split of each tile); the
    counters are allocated on the first call, so run once before capturing a CUDA graph.
    """
    m, k = a_codes.shape
    n = b_codes.shape[0]
    assert b_codes.shape[1] == k and a_codes.stride(1) == 1 and b_codes.stride(1) == 1, (a_codes.shape, b_codes.shape)
    assert a_scales.shape == (m, triton.cdiv(k, 128)) and b_scales.shape == (triton.cdiv(n, 128), triton.cdiv(k, 128))
    assert b_scales.stride(1) == 1  # a_scales may be row- or column-major (quantize(col_major_scales=...))
    cfg = config or small_m_config(m, n, k)
    groups_per_split = triton.cdiv(triton.cdiv(k, 128), cfg.split_k)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), cfg.split_k)
    out = torch.empty((m, n), dtype=out_dtype, device=a_codes.device)
    if cfg.split_k > 1 and grid[0] * grid[1] > MAX_TILES:
        cfg = SmallMConfig(cfg.block_m, cfg.block_n, 1, cfg.num_warps, cfg.num_stages)  # no counters needed
        groups_per_split, grid = triton.cdiv(k, 128), (grid[0], grid[1], 1)
    if cfg.split_k > 1:
        work = torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=a_codes.device)
        counters = tile_counters(a_codes.device)
    else:
        work = counters = out  # unused
    _gemm_small_m_kernel[grid](
        a_codes, a_scales, b_codes, b_scales, out, work, counters,
        m, n, k, a_codes.stride(0), b_codes.stride(0), a_scales.stride(0), a_scales.stride(1), b_scales.stride(0),
        out.stride(0),
        GROUPS_PER_SPLIT=groups_per_split, SPLIT_K=cfg.split_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
