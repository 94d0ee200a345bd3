"""Exact mode's FP8 GEMM: batch-invariant, with a fixed K split per layer that a decode step runs across the GPU.

Spec: :func:`jetrl.fp8.gemm.gemm_emulated`. Exact mode (jetrl/exact.py) sends a layer's forward FP8 GEMMs here, in
the trainer's forward and in the rollout alike, so a row's output is the same bits at every M -- where the Gluon
kernel cannot take the layer (not Hopper, K not a multiple of 256: jetrl/fp8/gemm.py ``_gemm_exact``); the Gluon
kernel is batch-invariant at any tile and 1.6-1.7x faster on an 8B layer.

The arithmetic, for a[M, K] in 1x128 groups (scales sa[M, K/128]) and b[N, K] in 128x128 blocks (scales
sb[N/128, K/128]): the K groups are cut into ``S`` runs of ``G`` groups (a function of K only: split_k.k_splits),
each run summed from zero, the runs summed in order::

    acc_s     = 0;  for g in run s:  acc_s += dot(a[rows, g], b[cols, g]^T) * sa[rows, g] * sb[cols // 128, g]
    out[r, c] = rnd(0 + acc_0 + acc_1 + ... + acc_{S-1})

Every dot is one FP8 tensor-core product of a 128-group into a fresh fp32 tile, on a fixed (BLOCK_M, BLOCK_N)
tile (``TILES``), so nothing in a row's sum depends on M. (The compiler may contract a group's scale-and-add into an
FMA: one binary serves every call, so it does so alike in all of them.)

Who computes it: where the output tiles would fill at most half the SMs (a decode step's qkv, o and down at up to
64 rows: 32-48 tiles of 64 x 128), each tile gets ``S`` programs, one per run, and the last to finish adds the
partials in run order; elsewhere (the trainer's thousands of rows) one program walks the ``S`` runs and adds them in
registers -- the same additions on the same values (split_k.merge_splits), in one binary (M and the program count
are runtime arguments, never specialized). Before run CU the kernel ran one program per tile and no split: at 64 rows
the o projection's 32 programs each streamed a 4096-long slice of the weight. Measured on the H200
(bench/sweep_exact_tiles.py, run CU; docs/benchmarks.md "Exact mode"): an 8B layer's four GEMMs at 64 rows 151 -> 110
µs under CUDA graphs; at 9216 rows the runs' second accumulator costs 6.7 -> 7.2 ms (these 4-warp tiles spill 16
words; 8 warps do not, and are slower at every M).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetrl.fp8.kernels.gemm_triton import scaled_group_product
from jetrl.fp8.kernels.split_k import k_splits, merge_splits, split_buffers

# fixed: part of the arithmetic (the tile; S, the K runs per layer)
TILES = {"BLOCK_M": 64, "BLOCK_N": 128, "SPLITS": 4, "num_warps": 4, "num_stages": 3}


# M, the activation scales' strides (M-sized when the scales are column-major) and the program count stay runtime
# values, so one binary serves every M and both ways of running a tile: Triton otherwise compiles a binary per value
# class (== 1, a multiple of 16), and binaries may round differently (models/kernels/exact_attention_triton.py).
@triton.jit(do_not_specialize=("M", "stride_sam", "stride_sak", "programs_k"))
def _gemm_exact_kernel(
    a_ptr, sa_ptr, b_ptr, sb_ptr, out_ptr, work_ptr, count_ptr,
    M, N, K, stride_am, stride_bn, stride_sam, stride_sak, stride_sbn, stride_om, programs_k,
    SPLITS: tl.constexpr, GROUPS_PER_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, 128)
    row_ok, col_ok = rows < M, cols < N
    runs = SPLITS // programs_k  # this program's runs: all S, or its own one
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    s, end = pid_k * runs, (pid_k + 1) * runs
    while s < end:  # a while loop: the interpreter's range() cannot take a runtime bound
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for i in range(GROUPS_PER_SPLIT):  # the small-M kernel's group term, on a fixed tile
            acc += scaled_group_product(a_ptr, sa_ptr, b_ptr, sb_ptr, rows, cols, row_ok, col_ok, offs_k,
                                        s * GROUPS_PER_SPLIT + i, K, stride_am, stride_bn, stride_sam, stride_sak,
                                        stride_sbn)
        total += acc
        s += 1
    tile_mask = row_ok[:, None] & col_ok[None, :]
    work = work_ptr + rows[:, None] * N + cols[None, :]
    tile_id = pid_m * tl.num_programs(0) + pid_n
    total, last = merge_splits(total, work, tile_mask, count_ptr + tile_id, pid_k, M * N, programs_k)
    if last:
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], total.to(out_ptr.dtype.element_ty),
                 mask=tile_mask)


def gemm_exact(a_codes: torch.Tensor, a_scales: torch.Tensor, b_codes: torch.Tensor, b_scales: torch.Tensor,
               out_dtype: torch.dtype = torch.bfloat16, programs_k: int | None = None) -> torch.Tensor:
    """out[M, N] = deq(a) @ deq(b)^T for a (M, K) 1x128 and b (N, K) 128x128 (row-major codes), the same bits for
    a row at every M. ``programs_k``: split_k.split_buffers (speed only). Run the GEMM once before capturing a CUDA
    graph (the first call allocates the device's counters)."""
    m, k = a_codes.shape
    n = b_codes.shape[0]
    assert b_codes.shape[1] == k and a_codes.stride(1) == 1 and b_codes.stride(1) == 1, (a_codes.shape, b_codes.shape)
    assert a_scales.shape == (m, triton.cdiv(k, 128)) and b_scales.shape == (triton.cdiv(n, 128), triton.cdiv(k, 128))
    assert b_scales.stride(1) == 1  # a_scales may be row- or column-major (quantize(col_major_scales=...))
    splits, per_split = k_splits(triton.cdiv(k, 128), TILES["SPLITS"])
    tiles = (triton.cdiv(n, TILES["BLOCK_N"]), triton.cdiv(m, TILES["BLOCK_M"]))
    out = torch.empty((m, n), dtype=out_dtype, device=a_codes.device)
    if m == 0:
        return out
    programs_k, work, counters = split_buffers(tiles[0] * tiles[1], splits, m, n, a_codes.device, programs_k)
    _gemm_exact_kernel[(*tiles, programs_k)](
        a_codes, a_scales, b_codes, b_scales, out, work, counters,
        m, n, k, a_codes.stride(0), b_codes.stride(0), a_scales.stride(0), a_scales.stride(1), b_scales.stride(0),
        out.stride(0), programs_k,
        SPLITS=splits, GROUPS_PER_SPLIT=per_split, BLOCK_M=TILES["BLOCK_M"], BLOCK_N=TILES["BLOCK_N"],
        num_warps=TILES["num_warps"], num_stages=TILES["num_stages"],
    )
    return out
