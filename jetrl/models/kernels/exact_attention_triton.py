"""Batch-invariant attention in Triton: one kernel, one tile shape, for the trainer, the prefill and the decode.

Spec: :func:`jetrl.models.exact_ops.exact_attention_reference` (softmax attention in fp32). Exact mode
(jetrl/exact.py) runs every attention of the trainer's forward and of the rollout through this kernel, so
a query row's output is the same bits whether it is one of 18,000 rows of a training micro-batch or one
of 256 rows of a decode step.

Why the same bits: a row's output depends only on the arithmetic applied to that row. Each program owns
BLOCK_M query rows of one (batch, kv head) -- rows enumerate (position t, query head g of the kv head's
group), so a decode step's G heads and a training tile's positions are the same kind of row -- and walks
the keys from 0 in tiles of BLOCK_N, in the base-2 online softmax (t_j = s_j log2 e)::

    s    = (q . K_tile^T) * scale * log2(e)          one tensor-core dot, fp32 accumulation
    s_j  = -inf where row r may not attend key j      (causal: j > t; a mask: mask[b, t, j] = 0)
    m'   = max(m, max_j s_j);  a = 2^(m - m');  p_j = 2^(s_j - m')
    l'   = a l + sum_j p_j;    acc' = dot(rnd(p), V_tile, accumulator a acc)
    out  = acc / l

with m starting at -1e30 (finite). A tile in which a row attends nothing leaves that row's (m, l, acc) as they
were -- selected, not recomputed as a = 1, p = 0, so nothing rests on a tensor-core dot returning its accumulator
bit for bit when every product is 0 -- and a training tile that runs past a row's causal limit for the sake of its
other rows, or a row whose mask ends before its tile does, ends with the bits of a walk that stopped at the
limit.

A KV cache (the engine's exact decode, ``exact_ops.exact_cache_attention``): ``lengths`` bounds row b's keys to
0..lengths[b], read in the kernel, so the loop stops at the row's own end instead of walking the static cache -- the
tiles it skips are ones in which no row attends a key, which leave every row's state as it was, so the bits are
those of the masked walk -- and an FP8 cache's E4M3 codes and per-token-head scales are dequantized in registers by
kv_quant.dequantize_kv's arithmetic (fp8/kernels/kv_dequant_triton.py): the values the trainer's forward attends
over after its quantize->dequantize of K and V. Both are runtime arguments of the same binary (the loads that a
call does not use read a stand-in), so the decode and the trainer still share one binary.

Every call with one head_dim runs the same binary -- causal or masked, prefill or decode. The causal limit is a
runtime shift, "no mask" a runtime flag (a mask's tile is loaded and reduced to the rows and keys that attend
anything; without one those two sets have a closed form, and only booleans differ), the sizes and the mask stay
unspecialized (Triton otherwise compiles a binary per argument value class, == 1 or a multiple of 16, and per
alignment), and q/k/v/out are contiguous and 16-byte aligned in every call (the wrapper copies where they are not),
so their addresses specialize alike and their loads vectorize along D. The kernel is compiled without FMA contraction
(``enable_fp_fusion=False``) and the P.V product accumulates inside the dot. Measured on the H200
(bench/probe_exact.py, a causal call against the same rows through a tril mask): two binaries (causal and masked
as compile-time flags) differed in the last bit of 13 of 10,624 rows; one source under Triton's default
specialization still in 7-10; one binary in none, and the decode's rows equal the trainer's in every row.

The tile shapes, warps and the order of every sum are constants of this file (``TILES``), never a
function of the batch, the sequence length or the GPU's occupancy (no split-K, no flash-decoding split):
that is the whole difference from SDPA's kernels and from the fused decode kernel, whose split count
follows the batch. Keys that no row of a tile may attend have their V zeroed before the dot, so stale
cache positions (which may hold NaN) never reach it; their probabilities are 0 either way.

Under ``TRITON_INTERPRET=1`` (the CPU tests) the dots are taken in IEEE fp32 on exactly upcast operands
and the roundings to the model dtype done on the bits (rounding.py), as in the decode attention kernel.

Not the fastest attention: 16-row tiles re-read K/V per 16 rows (from L2) in training, and a decode step fills 4
of them (G = 4). A decode is bound by each program's chain of per-tile instructions (a (batch, kv head) pair walks
its keys alone), so a tile's work is kept small: a *full* tile (every key exists and every real row may attend it,
no mask: all of a decode's walk but its last tile, a causal walk below the diagonal) skips the masking and the
selection by a runtime branch (607 SASS instructions per warp and BF16 tile against 1045 for a partial one; an FP8
cache adds ~645 for the dequantization: bench/sass_exact_attention.py), and two warps split a tile's keys (one warp
holds a 64-key tile's registers poorly, four pay for their cross-warp reductions). Measured on the H200
(bench/sweep_exact_tiles.py, runs DE-DF; µs under CUDA graphs, B = 64 / 256 rows of mean context 640, FP8 cache):
the kernel before these two changes 113 / 352, with them 74 / 210; 4 warps 86 / 274, 1 warp 133 / 274, 32-key tiles
with 2 warps 91 / 253; the causal forward over 8 x 1152 tokens 1.48 ms (64-row tiles 1.2 ms, but 1.3x slower
decodes: runs CQ-CR). A software-pipelined for loop (run CR, code not kept) sped the decode by 8% in isolation but
slowed the forward by 1.4x and the engine's exact decode step by 10-18%; keys merged in chunks at fixed positions
(runs CW-CX) were not faster.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from jetrl.fp8.kernels.kv_dequant_triton import dequantized
from jetrl.fp8.kernels.rounding import INTERPRET, round_to
from jetrl.models.kernels import aligned_contiguous

TILES = {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 2, "num_stages": 2}  # fixed: part of the arithmetic
LOG2E = math.log2(math.e)


@triton.jit
def _dot(a, b, acc, EMULATE: tl.constexpr):
    """acc + a @ b in fp32: one tensor-core dot accumulating into ``acc`` on the GPU, IEEE fp32 under the
    interpreter. The accumulator is the dot's own input, never a separate add: the compiler may fold an add of a
    dot into the dot, in one binary and not in another, and the two round differently."""
    if EMULATE:
        return acc + tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif a.dtype == tl.float32:  # an fp32 model: IEEE fp32 products, not TF32
        return tl.dot(a, b, acc, input_precision="ieee", out_dtype=tl.float32)
    else:
        return tl.dot(a, b, acc, out_dtype=tl.float32)


# Every integer argument, and the addresses of the mask, the scales and the lengths, stay runtime values: Triton
# otherwise compiles a binary per value class (== 1, multiple of 16) and alignment, and binaries may round
# differently (module docstring). q, k, v, the codes and out are contiguous and 16-byte aligned in every call (the
# wrapper makes them so, or passes an aligned stand-in), so their loads vectorize along D.
_UNSPECIALIZED = ("mask_ptr", "ks_ptr", "vs_ptr", "len_ptr", "T", "S", "G", "HKV", "qk_scale", "shift", "smb", "smt",
                  "sms", "FP8_KV", "CACHE_LENGTHS", "HAS_MASK")


@triton.jit
def _kv_tile(x_ptr, codes_ptr, scales_ptr, kv_row, j, d, j_ok, FP8_KV, D: tl.constexpr, DTYPE: tl.constexpr,
             EMULATE: tl.constexpr):
    """A (BLOCK_N, D) tile of K or V in the model dtype, 0 where ``j_ok`` is off: loaded as is, or (FP8_KV, a runtime
    branch of the same binary) dequantized from E4M3 codes and per-token-head scales as kv_quant.dequantize_kv."""
    offs = kv_row * D + j[:, None] * D + d[None, :]
    if FP8_KV != 0:
        x = dequantized(tl.load(codes_ptr + offs, mask=j_ok[:, None], other=0), scales_ptr + kv_row, j, 1, j_ok,
                        DTYPE, EMULATE)
    else:
        x = tl.load(x_ptr + offs, mask=j_ok[:, None], other=0.0)
    return x


@triton.jit(do_not_specialize=_UNSPECIALIZED, do_not_specialize_on_alignment=_UNSPECIALIZED)
def _exact_attention_kernel(
    q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, len_ptr, mask_ptr, out_ptr,
    T, S, G, HKV, qk_scale, shift, smb, smt, sms, FP8_KV, CACHE_LENGTHS, HAS_MASK,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EMULATE: tl.constexpr,
):
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, kvh = bh // HKV, bh % HKV
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < T * G
    t = r // G
    h = kvh * G + r % G
    d = tl.arange(0, D)
    q_rows = (b * HKV * G + h).to(tl.int64) * T + t  # q and out: (B, H, T, D) contiguous
    q = tl.load(q_ptr + q_rows[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
    DTYPE: tl.constexpr = q_ptr.dtype.element_ty
    m_i = tl.full((BLOCK_M,), -1e30, tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    # keys [0, n_keys) exist: all S, or a KV cache row's 0..lengths[b]; the loop stops at the tile's last key
    n_keys = S
    if CACHE_LENGTHS != 0:
        n_keys = tl.minimum(tl.load(len_ptr + b).to(tl.int32) + 1, S)
    # row r may attend key j < n_keys iff j <= t + shift and mask[b, t, j]: shift = 0 is causal, shift = S no limit
    t_last = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // G, T - 1)  # the tile's last position
    hi = tl.minimum(t_last + shift + 1, n_keys)
    kv_row = (b * HKV + kvh).to(tl.int64) * S  # k, v and the codes: (B, Hkv, S, D) contiguous; scales (B, Hkv, S)
    t_first = (pid_m * BLOCK_M) // G  # the tile's first position
    start = 0
    while start < hi:  # a while loop: the interpreter's range() cannot take a runtime bound
        j = start + tl.arange(0, BLOCK_N)
        j_ok = j < n_keys
        k = _kv_tile(k_ptr, kc_ptr, ks_ptr, kv_row, j, d, j_ok, FP8_KV, D, DTYPE, EMULATE)
        s = _dot(q, tl.trans(k), tl.zeros((BLOCK_M, BLOCK_N), tl.float32), EMULATE) * qk_scale
        # A partial tile has a key that some real row may not attend (past the row's end, its causal limit, or
        # masked). A full one -- every tile of a decode's walk but its last, every causal tile below the
        # diagonal -- skips the masking and the selection: for a real row they would leave every value as it is
        # (its padding rows compute on q = 0 and are never stored). A runtime branch: one binary, the same bits.
        partial = (HAS_MASK != 0) | (start + BLOCK_N > n_keys) | (start + BLOCK_N - 1 > t_first + shift)
        live = row_ok  # rows with a key in this tile
        any_row = j_ok  # keys some row attends
        if partial:
            valid = row_ok[:, None] & j_ok[None, :] & (j[None, :] <= t[:, None] + shift)
            if HAS_MASK != 0:
                allowed = tl.load(mask_ptr + b * smb + t[:, None] * smt + j[None, :] * sms, mask=valid, other=0)
                valid = valid & (allowed != 0)
                live = tl.max(valid.to(tl.int32), axis=1) > 0
                any_row = tl.max(valid.to(tl.int32), axis=0) > 0
            else:  # the same two sets in closed form (start < n_keys in the loop): no reduction, no mask load
                live = row_ok & (start <= t + shift)
                any_row = j_ok & (j <= t_last + shift)
            s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        v = _kv_tile(v_ptr, vc_ptr, vs_ptr, kv_row, j, d, j_ok, FP8_KV, D, DTYPE, EMULATE)
        if partial:
            v = tl.where(any_row[:, None], v, tl.zeros_like(v))
        acc_new = _dot(round_to(p, v.dtype, EMULATE), v, acc * alpha[:, None], EMULATE)
        l_new = l_i * alpha + tl.sum(p, axis=1)
        if partial:  # a row with no key in this tile keeps its state bit for bit: selected, not recomputed
            acc = tl.where(live[:, None], acc_new, acc)
            l_i = tl.where(live, l_new, l_i)
            m_i = tl.where(live, m_new, m_i)
        else:
            acc, l_i, m_i = acc_new, l_new, m_new
        start += BLOCK_N
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a row that may attend nothing gives 0, not NaN
    tl.store(out_ptr + q_rows[:, None] * D + d[None, :], round_to(out, DTYPE, EMULATE), mask=row_ok[:, None])


def exact_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                           causal: bool, scale: float, *, lengths: torch.Tensor | None = None,
                           k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v for q (B, H, T, D), k/v (B, Hkv, S, D), H a multiple of Hkv (copied where
    not contiguous); ``mask`` a bool (B|1, 1, T, S) "may attend" tensor (any strides) or None; ``causal`` (T == S)
    masks j > t too. A KV cache's rows: ``lengths`` (B,) int64, row b's keys are 0..lengths[b] (the rest of the
    static cache is never read); with ``k_scales``/``v_scales`` (B, Hkv, S) fp32, k/v are its E4M3 codes (uint8 or
    float8_e4m3fn), dequantized as kv_quant.dequantize_kv.
    Returns (B, H, T, D) in q's dtype. The caller validates (jetrl/models/exact_ops.py)."""
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = H // Hkv
    q = aligned_contiguous(q)
    # one binary for every call: the arguments a call does not use get a stand-in of the same type and alignment
    stand_in = torch.empty(16, dtype=torch.uint8, device=q.device)
    fp8 = k_scales is not None
    if fp8:
        codes = tuple(aligned_contiguous(x).view(torch.uint8) for x in (k, v))
        scales = tuple(x.contiguous() for x in (k_scales, v_scales))
        k = v = q  # unread
    else:
        k, v = aligned_contiguous(k), aligned_contiguous(v)
        codes, scales = (stand_in, stand_in), (stand_in.view(torch.float32),) * 2
    cache_lengths = lengths is not None
    lengths = lengths.contiguous() if cache_lengths else stand_in.view(torch.int64)
    out = torch.empty((B, H, T, D), dtype=q.dtype, device=q.device)
    has_mask = mask is not None
    if has_mask:
        mask = mask.expand(mask.shape[0], 1, T, S).view(torch.uint8)
        sm = (0 if mask.shape[0] == 1 else mask.stride(0), mask.stride(2), mask.stride(3))
    else:  # unread: a stand-in of the mask's type
        mask, sm = stand_in, (0, 0, 0)
    grid = (triton.cdiv(T * G, TILES["BLOCK_M"]), B * Hkv)
    _exact_attention_kernel[grid](
        q, k, v, *codes, *scales, lengths, mask, out, T, S, G, Hkv, float(scale) * LOG2E, 0 if causal else S, *sm,
        int(fp8), int(cache_lengths), int(has_mask),
        D=D, BLOCK_M=TILES["BLOCK_M"], BLOCK_N=TILES["BLOCK_N"], EMULATE=INTERPRET,
        num_warps=TILES["num_warps"], num_stages=TILES["num_stages"], enable_fp_fusion=False,
    )
    return out
