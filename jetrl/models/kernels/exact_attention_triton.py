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
other rows, or a decode row that walks the whole static cache, ends with the bits of a walk that stopped at the
limit.

Every call with one head_dim runs the same binary -- causal or masked, prefill or decode. The causal limit is a
runtime shift, "no mask" an all-true mask read with zero strides, the sizes and the mask stay unspecialized
(Triton otherwise compiles a binary per argument value class, == 1 or a multiple of 16, and per alignment), and
q/k/v/out are contiguous and 16-byte aligned in every call (the wrapper copies where they are not), so their
addresses specialize alike and their loads vectorize along D. The kernel is compiled without FMA contraction
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

Not the fastest attention: 16-row tiles re-read K/V per 16 rows (from L2), and the decode reads the
whole static cache (its mask, not its lengths, bounds the rows). Exact mode trades that for bit-equality.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from jetrl.fp8.kernels.rounding import INTERPRET, round_to
from jetrl.models.kernels import aligned_contiguous

TILES = {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}  # fixed: part of the arithmetic
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


# Every integer argument, and the mask's address, stay runtime values: Triton otherwise compiles a binary per value
# class (== 1, multiple of 16) and alignment, and binaries may round differently (module docstring). q, k, v and
# out are contiguous and 16-byte aligned in every call (the wrapper makes them so), so their loads vectorize along D.
_UNSPECIALIZED = ("mask_ptr", "T", "S", "G", "HKV", "qk_scale", "shift", "smb", "smt", "sms")


@triton.jit(do_not_specialize=_UNSPECIALIZED, do_not_specialize_on_alignment=_UNSPECIALIZED)
def _exact_attention_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr,
    T, S, G, HKV, qk_scale, shift, smb, smt, sms,
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
    m_i = tl.full((BLOCK_M,), -1e30, tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    # row r may attend key j iff j <= t + shift and mask[b, t, j]: shift = 0 is causal, shift = S no limit
    hi = tl.minimum(tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // G, T - 1) + shift + 1, S)
    kv_base = (b * HKV + kvh).to(tl.int64) * S * D  # k and v: (B, Hkv, S, D) contiguous
    start = 0
    while start < hi:  # a while loop: the interpreter's range() cannot take a runtime bound
        j = start + tl.arange(0, BLOCK_N)
        j_ok = j < S
        k = tl.load(k_ptr + kv_base + j[:, None] * D + d[None, :], mask=j_ok[:, None], other=0.0)
        s = _dot(q, tl.trans(k), tl.zeros((BLOCK_M, BLOCK_N), tl.float32), EMULATE) * qk_scale
        valid = row_ok[:, None] & j_ok[None, :] & (j[None, :] <= t[:, None] + shift)
        allowed = tl.load(mask_ptr + b * smb + t[:, None] * smt + j[None, :] * sms, mask=valid, other=0)
        valid = valid & (allowed != 0)
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        v = tl.load(v_ptr + kv_base + j[:, None] * D + d[None, :], mask=j_ok[:, None], other=0.0)
        any_row = tl.max(valid.to(tl.int32), axis=0) > 0
        v = tl.where(any_row[:, None], v, tl.zeros_like(v))
        acc_new = _dot(round_to(p, v.dtype, EMULATE), v, acc * alpha[:, None], EMULATE)
        # a row with no key in this tile keeps its state bit for bit: selected, not recomputed (module docstring)
        live = tl.max(valid.to(tl.int32), axis=1) > 0
        acc = tl.where(live[:, None], acc_new, acc)
        l_i = tl.where(live, l_i * alpha + tl.sum(p, axis=1), l_i)
        m_i = tl.where(live, m_new, m_i)
        start += BLOCK_N
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a row that may attend nothing gives 0, not NaN
    tl.store(out_ptr + q_rows[:, None] * D + d[None, :],
             round_to(out, out_ptr.dtype.element_ty, EMULATE), mask=row_ok[:, None])


def exact_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                           causal: bool, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v for q (B, H, T, D), k/v (B, Hkv, S, D), H a multiple of Hkv (copied where
    not contiguous); ``mask`` a bool (B|1, 1, T, S) "may attend" tensor (any strides) or None; ``causal`` (T == S)
    masks j > t too.
    Returns (B, H, T, D) in q's dtype. The caller validates (jetrl/models/exact_ops.py)."""
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = H // Hkv
    q, k, v = (aligned_contiguous(x) for x in (q, k, v))
    out = torch.empty((B, H, T, D), dtype=q.dtype, device=q.device)
    if mask is None:  # one binary for every call: no mask is an all-true one, read with zero strides
        mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=q.device)
    mask = mask.expand(mask.shape[0], 1, T, S).view(torch.uint8)
    sm = (0 if mask.shape[0] == 1 else mask.stride(0), mask.stride(2), mask.stride(3))
    grid = (triton.cdiv(T * G, TILES["BLOCK_M"]), B * Hkv)
    _exact_attention_kernel[grid](
        q, k, v, mask, out, T, S, G, Hkv, float(scale) * LOG2E, 0 if causal else S, *sm,
        D=D, BLOCK_M=TILES["BLOCK_M"], BLOCK_N=TILES["BLOCK_N"], EMULATE=INTERPRET,
        num_warps=TILES["num_warps"], num_stages=TILES["num_stages"], enable_fp_fusion=False,
    )
    return out
