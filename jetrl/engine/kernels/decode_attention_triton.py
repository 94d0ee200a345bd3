"""Triton flash-decoding over the static KV cache; its spec is
:func:`jetrl.engine.decode_attention.decode_attention_reference` (the math is in that module).

Grid and tiles. One program per (row b, kv head, split) handles all ``G = H / Hkv`` query heads
of its kv head together, so each K/V tile is loaded from HBM once, not G times. Both products are
taken *transposed*, with the positions as the tensor-core M dimension and the G heads as N::

    q^T     (BLOCK_D, BLOCK_G)   loaded once; BLOCK_G = next_pow2(G), Triton pads N to the mma's 8
    for tiles of BLOCK_S positions in [start, end):
        K_hat   (BLOCK_S, BLOCK_D)   A operand, K-major as stored (D contiguous)
        t^T     = (K_hat @ q^T) * sm_scale * log2(e)          (BLOCK_S, BLOCK_G) fp32
        online softmax update of (m, l, acc^T) in fp32         (base 2, module docstring)
        acc^T  += V_hat^T @ P^T                                V_hat^T: (BLOCK_D, BLOCK_S) A operand

Why transposed: G = 4 (H = 32, Hkv = 8) as M would be padded to the mma's 16 rows, and the
padded q, P and accumulator tiles cost registers (210 per thread at 128 positions), which capped
the SMs at 8 warps; as N it is padded to 8 only. One warp per program (the sweep's best) keeps P
in the warp that computed it -- no shared-memory exchange, no barrier per tile -- and many
programs per SM hide the latency instead. The padding is free either way: decode is memory-bound
(G = 4 is a few FLOPs per byte of K/V against ~200 per byte that the tensor cores sustain).

The loop runs to the row's own end, ``lengths[b] + 1`` read inside the kernel, never to S: the
stale tail of the static cache costs no bytes, and with no host sync the launch is CUDA-graph
capturable. Masked loads return 0 and masked logits are set to -inf by ``where``, so stale
NaN/Inf never enter the arithmetic.

Splits. With ``B * Hkv`` programs too few to fill the GPU (small batches, long rows), each
row's valid range is cut into ``num_splits`` chunks of ``ceil(ceil(n / num_splits) / BLOCK_S)``
tiles; split i writes ``o_i = acc_i / l_i`` and ``lse_i = m_i + log2 l_i`` into fp32 scratch
(B, H, num_splits, D) and (B, H, num_splits), and a second kernel merges the used splits in a
fixed order. :func:`choose_num_splits` picks the count from shapes only (at least 4 programs per SM,
each split at least 2 tiles long), so a given shape always gives the same bits. A row's bits do
depend on ``num_splits``, hence on the batch size; pass ``num_splits`` to pin them.

o_proj's FP8 input. With ``quantized`` buffers (jetrl/fp8/producer_quant.py) the last kernel -- this one,
or the split merge -- also writes the 1x128 codes and scales of its output as o_proj reads it, (B, H * D):
with D = 128 a head is one group, so the epilogue is the quantizer's row function on the rounded output, and
the codes are ``quantize``'s bit for bit. Measured on the H200 (bench/sweep_attention_splits.py): at B = 64
(two splits, the merge quantizes) it adds 0.05-0.4 µs against a 2.1 µs quantize launch; at B = 256 over the
FP8 cache (one split) nothing; over a BF16 cache in one split it added 6 µs (the separate pass: 2.8), so
there the wrapper quantizes after the kernel instead.

Row order. Rows of a rollout batch differ in length by up to 10x, and a program's time is its
row's length, so the launch order matters: started in batch order, the long rows that happen to
come last run alone at the end (a tail of idle SMs). With ``row_order`` (a permutation of the rows,
longest first; the engine computes it once per decode step with an argsort on the GPU), program
``pid`` takes row ``row_order[pid // Hkv]``, so the long rows start first and the short ones fill
the gaps. Each row's arithmetic is unchanged, so are its bits. Measured on the H200 (B = 256,
lengths 128-1152, one call, same data): FP8 pow2 117 -> 94 µs and BF16 180 -> 160 µs; at lengths
128-4096, 361 -> 290 µs. With the order the BF16 rule for ``num_splits`` is also the FP8 one (it
was doubled for FP8 without it).

Numerics, model-dtype cache and FP8 with fp32 scales. Both products multiply model-dtype values
exactly and accumulate in fp32. FP8 codes are dequantized in registers exactly as
``dequantize_kv``: fp32 ``codes * scale``, one RNE rounding to the model dtype. P^T @ V uses
P = hi + lo (both in the model dtype; P - hi is exact in fp32), two tensor-core products that keep
~16 bits of each probability instead of the 8 of a plain BF16 cast. fp32 models use IEEE fp32 dots.

Numerics, FP8 with power-of-two scales (``pow2_scales``, the ``jet_kv`` cache; bf16 and fp16 models,
fp32 ones take the path above). With s = 2^k,
``codes * s`` is exact and so is every product with it, so the scales leave the dots with no
rounding difference (up to fp32 summation order, as everywhere here):

    t_j  = (q . c_j) s_j sm_scale                  q . c_j on tensor cores in fp16: codes are exact
                                                   in fp16, and q enters as fp16(q 2^e) with 2^e
                                                   putting max|q| in [2^13, 2^14): exact for every
                                                   element >= max|q| 2^-31 (bf16; 2^-27 for fp16),
                                                   the rest below the fp32 rounding of the sum;
                                                   2^-e goes into sm_scale
    sum_j p_j V_hat_j = s_max sum_j (p_j s_j / s_max) c_j      s_max: the tile's largest V scale

The factor ``p_j s_j / s_max`` <= 1 is exact in fp32 and enters the product as one fp16 (11
significant bits, a relative rounding error <= 2^-11; the trainer's flash attention multiplies V
by a BF16 P, 8 bits), so the only per-element work left is the hardware E4M3 -> fp16 conversion.
``POW2_P_TERMS = 2`` splits it as hi + lo instead (two products, ~22 bits): on the H200 (run AZ,
``bench/sweep_attention_p_terms.py``) one term is 2.6% faster at B = 256 / ctx 649 (92.6 vs 95.1
µs) and 3.2% at B = 64 / ctx 3.6K (128.0 vs 132.1 µs), its max error against the fp32 reference 3.9e-3
vs 9.8e-4 at 3.6K (the same 7.8e-3 at B = 256, where the output's bf16 rounding dominates), and
the engine-vs-trainer logprob gap of ``jet_kv`` unchanged: 8.82e-3 vs 8.83e-3, mean of 5 seeds
(``jet``: 8.17e-3). V's reduction axis (positions) is not contiguous, and with 8-bit
codes Triton moves V into the mma layout one ld.shared.b8 per element; the conversion to fp16 is
therefore pinned (impure inline PTX) before that move, which then uses ldmatrix.trans.

Cost (H200, B = 256, mean context 640, ``jetrl bench --sections d``, rows longest first, 2026-11-30):
BF16 cache 158 µs (4.3 TB/s of valid K/V); FP8 with fp32 scales 131 µs; FP8 with pow2 scales 90 µs
(3.9 TB/s, 1.77x the BF16 cache; run BA, P as one fp16 term; 92 µs with hi + lo). At B = 64, 3.6K context
(sweep, before the row order and with hi + lo): 232, 193 and 135 µs (1.72x). Measured and dropped before
this layout (docs/benchmarks.md, section d): fp16 codes with fp32 scales outside the dots, E4M3
tensor-core dots, a transposed V cache, loosened length masks.

Interpreter (TRITON_INTERPRET=1, the CPU tests): its tl.dot multiplies the raw uint16 storage of
bf16 operands and its fp32 -> bf16 cast truncates, so with EMULATE the dots are taken in IEEE
fp32 on the same (exactly upcast) operands and the bf16 rounding is done on the fp32 bits; the
E4M3 conversion is a plain cast (inline PTX cannot run there). Same values as the GPU path, up to
summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetrl.engine.decode_attention import quantize_output
from jetrl.fp8.kernels import sm_count
from jetrl.fp8.kernels.kv_dequant_triton import dequantized, e4m3_to_f16
from jetrl.fp8.kernels.pdl import release, release_rows
from jetrl.fp8.kernels.quant_triton import explicit_round, quantize_rows
from jetrl.fp8.kernels.rounding import INTERPRET, round_to
from jetrl.fp8.quant import BLOCK as GROUP
from jetrl.fp8.quant import E4M3

LOG2E = 1.4426950408889634
PROGRAMS_PER_SM = 4  # split rule: grid of >= 4 programs per SM (loads in flight, fewer idle SMs in the last wave)
MIN_SPLIT_TILES = 2  # a split covers at least this many BLOCK_S tiles of the longest possible row
MAX_SPLITS = 32
EPILOGUE_HEAD_DIM = GROUP  # o_proj's input quantized in the epilogue when a head is one 1x128 group
# warps per (row, head) program of the split merge: 1 keeps its reductions (over the splits, and the epilogue's
# amax over D) inside a warp; at B = 64 the merge with the epilogue took 1.6 µs more with 4 warps, 0.05 with 1
# (bench/sweep_attention_splits.py, docs/benchmarks.md (d))
MERGE_WARPS = 1
DEFAULT_NUM_SMS = 132  # H100 / H200; used off-GPU (interpreter)
# (block_s, num_warps, num_stages) per cache kind: the H200 sweep's best (bench/sweep_decode_attention.py)
DEFAULT_TILES = {"model dtype": (32, 1, 2), "fp8": (32, 1, 3), "fp8 pow2": (32, 1, 3)}
# fp16 terms of P in the pow2 path's P V product (module docstring): 1 = one fp16 (11 bits), 2 = hi + lo (~22)
POW2_P_TERMS = 1
_EMULATE = INTERPRET
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _dot(a, b, EMULATE: tl.constexpr):
    """a @ b with fp32 accumulation: tensor cores for bf16/fp16, IEEE fp32 for fp32 (and EMULATE)."""
    if EMULATE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _load_tile(row_ptr, pos, offs_d, stride_s, stride_d, s_mask, d_mask):
    """A (BLOCK_S, BLOCK_D) tile of the cache in its storage dtype, masked (stale or padded) entries 0."""
    return tl.load(row_ptr + pos[:, None] * stride_s + offs_d[None, :] * stride_d,
                   mask=s_mask[:, None] & d_mask[None, :], other=0)


@triton.jit
def _attend_tile(qT, m, l, accT, tile_start, end, offs_s, offs_d, d_mask, qk_scale,
                 k_row, ks_row, stride_ks, stride_kd, stride_kss, v_row, vs_row, stride_vs, stride_vd, stride_vss,
                 DTYPE: tl.constexpr, IS_FP8: tl.constexpr, POW2_SCALES: tl.constexpr, EMULATE: tl.constexpr,
                 P_TERMS: tl.constexpr):
    """One BLOCK_S tile of the online softmax, transposed (module docstring): the updated (m, l, accT)."""
    pos = tile_start + offs_s
    s_mask = pos < end
    k = _load_tile(k_row, pos, offs_d, stride_ks, stride_kd, s_mask, d_mask)
    if POW2_SCALES:  # qT is fp16 q^T * 2^e (kernel); the K scales go outside the dot, exactly
        k_scale = tl.load(ks_row + pos * stride_kss, mask=s_mask, other=0.0)
        k = k.to(tl.float8e4nv, bitcast=True).to(tl.float16)  # the A operand is K-major: no layout change
        tT = _dot(k, qT, EMULATE) * (k_scale * qk_scale)[:, None]
    else:
        if IS_FP8:
            k = dequantized(k, ks_row, pos, stride_kss, s_mask, DTYPE, EMULATE)
        tT = _dot(k, qT, EMULATE) * qk_scale  # (BLOCK_S, BLOCK_G) base-2 logits
    tT = tl.where(s_mask[:, None], tT, float("-inf"))
    m_new = tl.maximum(m, tl.max(tT, axis=0))  # finite: every tile holds a valid position
    alpha = tl.exp2(m - m_new)
    pT = tl.exp2(tT - m_new[None, :])
    v = _load_tile(v_row, pos, offs_d, stride_vs, stride_vd, s_mask, d_mask)
    if POW2_SCALES:  # P V_hat = s_max (P * (s / s_max)) codes, all factors exact (module docstring)
        v_scale = tl.load(vs_row + pos * stride_vss, mask=s_mask, other=0.0)
        s_max = tl.max(v_scale, axis=0)
        pw = pT * (v_scale / s_max)[:, None]
        p_hi = pw.to(tl.float16)
        vT = tl.trans(e4m3_to_f16(v, EMULATE))
        if P_TERMS == 2:
            p_lo = (pw - p_hi.to(tl.float32)).to(tl.float16)
            pv = (_dot(vT, p_hi, EMULATE) + _dot(vT, p_lo, EMULATE)) * s_max
        else:
            pv = _dot(vT, p_hi, EMULATE) * s_max
    else:
        if IS_FP8:
            v = dequantized(v, vs_row, pos, stride_vss, s_mask, DTYPE, EMULATE)
        vT = tl.trans(v)
        if DTYPE == tl.float32:
            pv = _dot(vT, pT, EMULATE)
        else:  # p = hi + lo, both in DTYPE; p - hi is exact in fp32 (module docstring)
            p_hi = pT.to(DTYPE)
            p_lo = (pT - p_hi.to(tl.float32)).to(DTYPE)
            pv = _dot(vT, p_hi, EMULATE) + _dot(vT, p_lo, EMULATE)
    return m_new, l * alpha + tl.sum(pT, axis=0), accT * alpha[None, :] + pv


@triton.jit
def _fp16_pow2_scaled(q):
    """(fp16 q * 2^e, 2^e) with max|q * 2^e| in [2^13, 2^14): exact for every element |q| >= max|q| 2^-31
    of a bf16 q (8 significant bits), >= max|q| 2^-27 of an fp16 q (11); never used for fp32 q."""
    qf = q.to(tl.float32)
    qmax = tl.max(tl.max(tl.abs(qf), axis=1), axis=0)
    e = tl.minimum(tl.maximum(140 - ((qmax.to(tl.int32, bitcast=True) >> 23) & 0xFF), -126), 127)
    f = ((e + 127) << 23).to(tl.float32, bitcast=True)  # 2^e from its exponent bits: exact
    return (qf * f).to(tl.float16), f


@triton.jit
def _split_chunk(n_valid, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    """Positions per split of a row with n_valid keys: a whole number of tiles."""
    return tl.cdiv(tl.cdiv(n_valid, NUM_SPLITS), BLOCK_S) * BLOCK_S


@triton.jit
def _store_head_codes(out, b, heads, head_mask, offs_d, codes_ptr, scales_ptr, num_heads, stride_sr, stride_sc,
                      POW2: tl.constexpr, EXPLICIT_ROUND: tl.constexpr, BLOCK_D: tl.constexpr):
    """The 1x128 quantization of o_proj's input row b, (H * 128) wide, for the heads of ``out``, a
    (len(heads), 128) tile in the model dtype: with D = 128 each head is one group, so this is the quantizer's
    row function (``quantize_rows``) on the stored values -- ``quantize``'s codes and scales, bit for bit."""
    code_bits, scale = quantize_rows(out.to(tl.float32), POW2, EXPLICIT_ROUND)
    tl.store(codes_ptr + (b * num_heads + heads[:, None]) * BLOCK_D + offs_d[None, :], code_bits,
             mask=head_mask[:, None])
    tl.store(scales_ptr + b * stride_sr + heads * stride_sc, scale, mask=head_mask)


@triton.jit
def _decode_attention_kernel(
    q_ptr, k_ptr, v_ptr, k_scales_ptr, v_scales_ptr, lengths_ptr, row_order_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    codes_ptr, codes_scales_ptr, stride_csr, stride_csc,
    num_kv_heads, S, D, qk_scale, stride_lb,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_ksb, stride_ksh, stride_kss,
    stride_vsb, stride_vsh, stride_vss,
    stride_ob, stride_oh, stride_od,
    G: tl.constexpr, DTYPE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, IS_FP8: tl.constexpr, POW2_SCALES: tl.constexpr, ROW_ORDER: tl.constexpr,
    EMULATE: tl.constexpr, P_TERMS: tl.constexpr, QUANT: tl.constexpr = False, QUANT_POW2: tl.constexpr = False,
    EXPLICIT_ROUND: tl.constexpr = False, RELEASE: tl.constexpr = False,
):
    release(RELEASE)  # as the last kernel (one split): o_proj's decode GEMM may start loading its weight (pdl.py)
    pid, split = tl.program_id(0), tl.program_id(1)
    b = pid // num_kv_heads
    if ROW_ORDER:  # the rows in the order given (longest first: module docstring)
        b = tl.load(row_order_ptr + b)
    b = b.to(tl.int64)  # int64: b * stride_kb can pass 2^31 on a large cache
    kv_head = (pid % num_kv_heads).to(tl.int64)
    # keys 0..lengths[b]; clamped so that a bad length can never read outside the row
    n_valid = (tl.minimum(tl.maximum(tl.load(lengths_ptr + b * stride_lb), 0), S - 1) + 1).to(tl.int32)
    chunk = _split_chunk(n_valid, NUM_SPLITS, BLOCK_S)
    start = split * chunk
    end = tl.minimum(start + chunk, n_valid)  # start >= end: an unused split, no loop, no store

    offs_g, offs_s, offs_d = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_D)
    g_mask, d_mask = offs_g < G, offs_d < D
    heads = kv_head * G + offs_g  # query heads of this kv head
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # (BLOCK_G, BLOCK_D)
    if POW2_SCALES:
        q, q_factor = _fp16_pow2_scaled(q)
        qk_scale = qk_scale / q_factor  # exact: a power of two
    qT = tl.trans(q)  # (BLOCK_D, BLOCK_G): the B operand of K @ q^T
    k_row = k_ptr + b * stride_kb + kv_head * stride_kh
    v_row = v_ptr + b * stride_vb + kv_head * stride_vh
    ks_row = k_scales_ptr + b * stride_ksb + kv_head * stride_ksh
    vs_row = v_scales_ptr + b * stride_vsb + kv_head * stride_vsh

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max of base-2 logits
    l = tl.zeros([BLOCK_G], tl.float32)  # running sum of 2^(t - m)
    accT = tl.zeros([BLOCK_D, BLOCK_G], tl.float32)  # running sum of 2^(t - m) V_hat, transposed
    if EMULATE:  # the interpreter cannot take a loaded scalar as a range() bound (its int() fails on numpy 2.4)
        tile_start = start
        while tile_start < end:
            m, l, accT = _attend_tile(qT, m, l, accT, tile_start, end, offs_s, offs_d, d_mask, qk_scale,
                                     k_row, ks_row, stride_ks, stride_kd, stride_kss,
                                     v_row, vs_row, stride_vs, stride_vd, stride_vss,
                                     DTYPE, IS_FP8, POW2_SCALES, EMULATE, P_TERMS)
            tile_start += BLOCK_S
    else:  # a for loop, so that Triton software-pipelines the K/V loads (num_stages)
        for tile_start in range(start, end, BLOCK_S):
            m, l, accT = _attend_tile(qT, m, l, accT, tile_start, end, offs_s, offs_d, d_mask, qk_scale,
                                     k_row, ks_row, stride_ks, stride_kd, stride_kss,
                                     v_row, vs_row, stride_vs, stride_vd, stride_vss,
                                     DTYPE, IS_FP8, POW2_SCALES, EMULATE, P_TERMS)

    out_mask = d_mask[:, None] & g_mask[None, :]  # (BLOCK_D, BLOCK_G), as accT
    if NUM_SPLITS == 1:
        out = round_to(accT / l[None, :], DTYPE, EMULATE)
        tl.store(out_ptr + b * stride_ob + heads[None, :] * stride_oh + offs_d[:, None] * stride_od, out,
                 mask=out_mask)
        if QUANT:  # o_proj's FP8 input (D = 128: a head is a group)
            _store_head_codes(tl.trans(out), b, heads, g_mask, offs_d, codes_ptr, codes_scales_ptr,
                              num_kv_heads * G, stride_csr, stride_csc, QUANT_POW2, EXPLICIT_ROUND, BLOCK_D)
    else:
        used = start < end
        l_safe = tl.where(l > 0, l, 1.0)  # l >= 1 in a used split; avoids 0/0 in an unused one
        part = (b * num_kv_heads * G + heads) * NUM_SPLITS + split  # scratch is (B, H, NUM_SPLITS[, D])
        tl.store(part_lse_ptr + part, m + tl.log2(l_safe), mask=g_mask & used)
        tl.store(part_out_ptr + part[None, :] * D + offs_d[:, None], accT / l_safe[None, :], mask=out_mask & used)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, lengths_ptr, out_ptr, H, S, D, stride_lb, stride_ob, stride_oh, stride_od,
    codes_ptr, codes_scales_ptr, stride_csr, stride_csc,
    DTYPE: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr, EMULATE: tl.constexpr, QUANT: tl.constexpr = False, QUANT_POW2: tl.constexpr = False,
    EXPLICIT_ROUND: tl.constexpr = False, RELEASE: tl.constexpr = False,
):
    """One program per (b, h): out = sum_i 2^(lse_i - M) o_i / sum_i 2^(lse_i - M) over the used splits."""
    release(RELEASE)  # o_proj's decode GEMM may start loading its weight (pdl.py)
    pid = tl.program_id(0).to(tl.int64)  # b * H + h
    b, h = pid // H, pid % H
    n_valid = (tl.minimum(tl.maximum(tl.load(lengths_ptr + b * stride_lb), 0), S - 1) + 1).to(tl.int32)
    num_used = tl.cdiv(n_valid, _split_chunk(n_valid, NUM_SPLITS, BLOCK_S))  # as in the first kernel
    offs_i, offs_d = tl.arange(0, SPLITS_P2), tl.arange(0, BLOCK_D)
    used, d_mask = offs_i < num_used, offs_d < D
    part = pid * NUM_SPLITS + offs_i
    lse = tl.load(part_lse_ptr + part, mask=used, other=float("-inf"))  # unused splits were never written
    w = tl.exp2(lse - tl.max(lse, axis=0))  # (SPLITS_P2,); 0 for unused splits (lse = -inf)
    o = tl.load(part_out_ptr + part[:, None] * D + offs_d[None, :], mask=used[:, None] & d_mask[None, :], other=0.0)
    out = round_to(tl.sum(w[:, None] * o, axis=0) / tl.sum(w, axis=0), DTYPE, EMULATE)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d * stride_od, out, mask=d_mask)
    if QUANT:  # o_proj's FP8 input, as in the first kernel
        head = tl.full([1], 0, tl.int64) + h
        _store_head_codes(tl.reshape(out, (1, BLOCK_D)), b, head, head < H, offs_d, codes_ptr, codes_scales_ptr, H,
                          stride_csr, stride_csc, QUANT_POW2, EXPLICIT_ROUND, BLOCK_D)


def choose_num_splits(batch: int, num_kv_heads: int, max_len: int, block_s: int, num_sms: int) -> int:
    """Splits per row, from shapes only: at least PROGRAMS_PER_SM programs per SM when the rows are long
    enough, each split >= MIN_SPLIT_TILES tiles of the longest possible row, at most MAX_SPLITS.

    On 132 SMs: B=256, Hkv=8 (2048 programs) -> 1, no merge; B=64 -> 2; B=16 -> 5; B=1, S=4096 -> 32.
    """
    programs = batch * num_kv_heads
    by_occupancy = triton.cdiv(PROGRAMS_PER_SM * num_sms, programs)
    by_length = max(1, max_len // (MIN_SPLIT_TILES * block_s))
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


def _num_sms(device: torch.device) -> int:
    return sm_count(device) if device.type == "cuda" else DEFAULT_NUM_SMS


def decode_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    *,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    sm_scale: float | None = None,
    pow2_scales: bool = False,
    row_order: torch.Tensor | None = None,
    block_s: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    quantized=None,
    merge_warps: int = MERGE_WARPS,
    p_terms: int | None = None,
) -> torch.Tensor:
    """Same signature and result as ``decode_attention_reference``: (B, H, D) in q.dtype.

    ``quantized`` (a :class:`jetrl.models.fused.QuantizedOutput`): also write the 1x128 FP8 quantization of the
    output as o_proj reads it, (B, H * D), into these buffers (codes contiguous, scales (B, H * D / 128) of any
    strides). With D = 128 the last kernel -- the split merge, or the attention itself over an FP8 cache --
    does it in its epilogue; otherwise the quantizer runs on the output (a model-dtype cache in one split:
    there the epilogue cost the H200 6 µs at B = 256, the separate pass 2.8; docs/benchmarks.md (d)).

    ``block_s``, ``num_splits`` (None: :func:`choose_num_splits`), ``num_warps`` and ``num_stages``
    (None: ``DEFAULT_TILES``, the H200 sweep's best per cache kind) exist for the bench's sweep.
    Inputs are validated by the public ``decode_attention``. ``pow2_scales`` and ``row_order``: see
    ``decode_attention``; the first selects the scales-outside path for an FP8 cache.
    """
    B, H, D = q.shape
    _, Hkv, S, _ = k.shape
    is_fp8 = k.dtype == E4M3
    assert k.shape == v.shape == (B, Hkv, S, D) and H % Hkv == 0, (q.shape, k.shape, v.shape)
    assert k.dtype == v.dtype and (is_fp8 or k.dtype == q.dtype) and (k_scales is not None) == is_fp8
    # fp32 models keep the in-loop dequantization: their q is not exact in fp16
    pow2_path = is_fp8 and pow2_scales and q.dtype != torch.float32
    kind = ("fp8 pow2" if pow2_path else "fp8") if is_fp8 else "model dtype"
    default_block_s, default_warps, default_stages = DEFAULT_TILES[kind]
    block_s, num_warps = block_s or default_block_s, num_warps or default_warps
    num_stages = num_stages or default_stages
    assert block_s >= 16 and block_s & (block_s - 1) == 0, block_s
    sm_scale = D**-0.5 if sm_scale is None else sm_scale
    if num_splits is None:
        num_splits = choose_num_splits(B, Hkv, S, block_s, _num_sms(q.device))
    out = torch.empty((B, H, D), dtype=q.dtype, device=q.device)
    if num_splits > 1:
        part_out = torch.empty((B, H, num_splits, D), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((B, H, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # not written
    if is_fp8:
        k, v = k.view(torch.uint8), v.view(torch.uint8)  # same strides; the kernel bitcasts to e4m3
        ks, vs, ks_strides, vs_strides = k_scales, v_scales, k_scales.stride(), v_scales.stride()
    else:
        ks, vs, ks_strides, vs_strides = lengths, lengths, (0, 0, 0), (0, 0, 0)  # placeholders, never read
    G, dtype = H // Hkv, _TL_DTYPES[q.dtype]
    block_d = max(16, triton.next_power_of_2(D))
    epilogue = quantized if D == EPILOGUE_HEAD_DIM and (is_fp8 or num_splits > 1) else None
    codes_args, quant_kw = _quant_args(epilogue, out)  # for the last kernel: this one, or the merge
    attn_args, attn_kw = (codes_args, quant_kw) if num_splits == 1 else _quant_args(None, out)
    _decode_attention_kernel[(B * Hkv, num_splits)](
        q, k, v, ks, vs, lengths, lengths if row_order is None else row_order, out, part_out, part_lse, *attn_args,
        Hkv, S, D, sm_scale * LOG2E, lengths.stride(0),
        *q.stride(), *k.stride(), *v.stride(), *ks_strides, *vs_strides, *out.stride(),
        G=G, DTYPE=dtype, BLOCK_G=triton.next_power_of_2(G), BLOCK_S=block_s, BLOCK_D=block_d,
        NUM_SPLITS=num_splits, IS_FP8=is_fp8, POW2_SCALES=pow2_path, ROW_ORDER=row_order is not None,
        EMULATE=_EMULATE, P_TERMS=POW2_P_TERMS if p_terms is None else p_terms, **attn_kw,
        RELEASE=num_splits == 1 and release_rows(q.device, B), num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        _merge_splits_kernel[(B * H,)](
            part_out, part_lse, lengths, out, H, S, D, lengths.stride(0), *out.stride(), *codes_args,
            DTYPE=dtype, NUM_SPLITS=num_splits, SPLITS_P2=triton.next_power_of_2(num_splits), BLOCK_S=block_s,
            BLOCK_D=block_d, EMULATE=_EMULATE, **quant_kw, RELEASE=release_rows(q.device, B), num_warps=merge_warps,
        )
    if quantized is not None and epilogue is None:
        quantize_output(out, quantized)
    return out


def _quant_args(quantized, out: torch.Tensor) -> tuple[tuple, dict]:
    """The epilogue's pointer/stride arguments and constexprs; ``out`` as a never-written placeholder without it."""
    if quantized is None:
        return (out, out, 0, 0), {}
    codes, scales, pow2 = quantized
    B, H, D = out.shape
    assert D == 128 and codes.shape == (B, H * D) and codes.is_contiguous() and codes.dtype == E4M3, codes.shape
    assert scales.shape == (B, H) and scales.dtype == torch.float32, (scales.shape, scales.dtype)
    return ((codes.view(torch.uint8), scales, *scales.stride()),
            {"QUANT": True, "QUANT_POW2": bool(pow2), "EXPLICIT_ROUND": explicit_round()})
