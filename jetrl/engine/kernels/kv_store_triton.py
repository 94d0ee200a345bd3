"""Triton: a decode step's K/V written into the static cache, quantized on the way, in one launch
(and a prefill's K/V into a model-dtype cache: ``store_prefill_triton``; an FP8 cache's prefill store is
the quantize->dequantize kernel's, :func:`jetrl.fp8.kv_quant.store_quantized_kv`).

Spec: :meth:`jetrl.engine.kv_cache.DecodeView.store_reference` -- for each row b and kv head h,
``cache[b, h, lengths[b]] = k[b, h]`` (and v), where an FP8 cache first quantizes each head
vector with :func:`jetrl.fp8.kv_quant.quantize_kv` (E4M3 codes + one fp32 scale per token-head).

Why: in PyTorch the store is two ``scatter_`` (BF16 cache) or two quantize kernels and four
``scatter_`` (FP8 cache: codes and scales of K and V) per layer, each a launch-bound kernel of a
few KB at decode sizes. Here one program handles one row: it reads the row's position, then K
and V of all its kv heads, and writes codes and scales (or the model-dtype values) in place.

Bit-identity with the trainer: the scale and the codes come from the quantizer's own jitted
function (``quantize_rows`` of :mod:`jetrl.fp8.kernels.quant_triton`), the arithmetic the Triton
quantizer does for a 1 x head_dim group, so the cache holds exactly what ``quantize_kv`` gives for
the same K/V (tested under ``TRITON_INTERPRET=1`` and checked on the GPU by the engine tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetrl.fp8.kernels.quant_triton import explicit_round, quantize_rows, split_rows


@triton.jit
def _store_one(x_ptr, sxb, sxh, cache_ptr, scb, sch, scp, scale_ptr, ssb, ssh, b, pos, heads, d, head_ok,
               FP8: tl.constexpr, POW2: tl.constexpr, EXPLICIT_ROUND: tl.constexpr):
    x = tl.load(x_ptr + b * sxb + heads[:, None] * sxh + d[None, :], mask=head_ok[:, None], other=0.0)
    dst = cache_ptr + b * scb + heads[:, None] * sch + pos * scp + d[None, :]
    if FP8:
        code_bits, scale = quantize_rows(x.to(tl.float32), POW2, EXPLICIT_ROUND)  # one group per token-head
        tl.store(dst, code_bits, mask=head_ok[:, None])
        tl.store(scale_ptr + b * ssb + heads * ssh + pos, scale, mask=head_ok)
    else:
        tl.store(dst, x, mask=head_ok[:, None])


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, lengths_ptr, ck_ptr, cv_ptr, sk_ptr, sv_ptr, num_heads, S,
                     skb, skh, svb, svh, scb, sch, scp, ssb, ssh,
                     D: tl.constexpr, BLOCK_H: tl.constexpr, FP8: tl.constexpr, POW2: tl.constexpr,
                     EXPLICIT_ROUND: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    pos = tl.load(lengths_ptr + b).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    head_ok = (heads < num_heads) & (pos >= 0) & (pos < S)  # a bad length never writes outside its row
    d = tl.arange(0, D)
    _store_one(k_ptr, skb, skh, ck_ptr, scb, sch, scp, sk_ptr, ssb, ssh, b, pos, heads, d, head_ok,
               FP8, POW2, EXPLICIT_ROUND)
    _store_one(v_ptr, svb, svh, cv_ptr, scb, sch, scp, sv_ptr, ssb, ssh, b, pos, heads, d, head_ok,
               FP8, POW2, EXPLICIT_ROUND)


def store_kv_triton(k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, cache_k: torch.Tensor,
                    cache_v: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                    pow2_scale: bool) -> None:
    """Write k, v (B, Hkv, 1, D) at positions ``lengths[:B]`` of ``cache_k``/``cache_v`` (B, Hkv, S, D) rows.

    FP8 when ``k_scale``/``v_scale`` (B, Hkv, S) fp32 are given: the caches are then uint8 views of
    the E4M3 codes. In place; no host sync (CUDA-graph capturable), so a position outside [0, S) is
    not checked but skipped: that row writes nothing (the engine never produces one; the PyTorch
    spec raises on it).
    """
    B, H, T, D = k.shape
    assert T == 1 and v.shape == k.shape and k.stride(-1) == v.stride(-1) == 1, (k.shape, v.shape)
    assert cache_k.stride() == cache_v.stride() and cache_k.stride(-1) == 1, (cache_k.stride(), cache_v.stride())
    fp8 = k_scale is not None
    if fp8:
        assert k_scale.stride() == v_scale.stride() and k_scale.stride(-1) == 1, (k_scale.stride(), v_scale.stride())
    ssb, ssh = (k_scale.stride(0), k_scale.stride(1)) if fp8 else (0, 0)
    _store_kv_kernel[(B,)](
        k, v, lengths, cache_k, cache_v, k_scale if fp8 else cache_k, v_scale if fp8 else cache_v, H, cache_k.shape[2],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), cache_k.stride(0), cache_k.stride(1), cache_k.stride(2),
        ssb, ssh, D=D, BLOCK_H=triton.next_power_of_2(H), FP8=fp8, POW2=pow2_scale,
        EXPLICIT_ROUND=explicit_round(), num_warps=4,
    )


@triton.jit
def _store_prefill_kernel(x_ptr, buf_ptr, slots_ptr, N, S1, S2, sx0, sx1, sx2, sx3, sb0, sb1, sb2,
                          D: tl.constexpr, TILE_R: tl.constexpr):
    # rows of D elements of x (S0, S1, S2, D), numbered row-major and read through x's strides (the model's K/V
    # are transposed views); row (i0, i1, i2) goes to buf[slots[i0], i1, i2]
    rows = tl.program_id(0).to(tl.int64) * TILE_R + tl.arange(0, TILE_R)
    ok = rows < N
    i0, i1, i2 = split_rows(rows, S1, S2)
    d = tl.arange(0, D)
    x = tl.load(x_ptr + (i0 * sx0 + i1 * sx1 + i2 * sx2)[:, None] + d[None, :] * sx3, mask=ok[:, None])
    slot = tl.load(slots_ptr + i0, mask=ok, other=0)
    tl.store(buf_ptr + (slot * sb0 + i1 * sb1 + i2 * sb2)[:, None] + d[None, :], x, mask=ok[:, None])


def store_prefill_triton(x: torch.Tensor, buf: torch.Tensor, slots: torch.Tensor) -> None:
    """``buf[slots, :, :T] = x`` for x (B, Hkv, T, D) of any strides and buf (S, Hkv, max_len, D) with unit last
    stride, one pass (PyTorch's indexed store runs at ~0.8 TB/s on a prefill's transposed K/V: docs/benchmarks.md
    (e)). D a power of two; the same bits as the indexed store (a copy)."""
    B, H, T, D = x.shape
    assert buf.dim() == 4 and buf.shape[1] == H and buf.shape[2] >= T and buf.shape[3] == D and buf.stride(3) == 1
    assert buf.dtype == x.dtype and slots.shape == (B,) and D & (D - 1) == 0, (x.shape, buf.shape, slots.shape)
    n = B * H * T
    tile_r = max(16, 4096 // D)
    _store_prefill_kernel[(triton.cdiv(n, tile_r),)](
        x, buf, slots, n, H, T, *x.stride(), *buf.stride()[:3], D=D, TILE_R=tile_r, num_warps=4)
