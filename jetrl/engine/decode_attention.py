"""Decode attention straight from the static KV cache, BF16 or FP8: one pending token per row.

Why a kernel: at RL batch sizes the KV cache, not the weights, dominates decode bytes
(design.md §5: at B=256 the per-step floor of an 8B model is 9.4 ms at 640 tokens of average
context and 39.8 ms at 4K, most of it K/V). Two things waste those bytes in the SDPA path:

* SDPA with a mask over the fixed-length static cache (kv_cache.py) reads all ``S = max_len``
  positions of every row, whatever the row's length: with mixed lengths that is
  ``S / mean(length)`` times the bytes that matter.
* An FP8 cache must first be dequantized to a model-dtype copy, so its K/V bytes are read
  once as codes, written once and read again in BF16: more traffic than a BF16 cache, not half.

:func:`decode_attention` reads only positions ``0..lengths[b]`` of row ``b``, and reads FP8
codes + scales directly (D + 4 bytes per token-head instead of 2 D), dequantizing in registers.

Math (the spec is :func:`decode_attention_reference`). Query head ``h`` reads kv head
``h // G``, ``G = H / Hkv`` (GQA, as SDPA's ``enable_gqa``). With ``n_b = lengths[b] + 1``::

    K_hat, V_hat = K, V                                      model-dtype cache
                 = rnd(f32(codes) * scales[..., None])       FP8 cache; rnd = RNE cast to q.dtype
    s_j   = sm_scale * <q_h, K_hat_j>                        j < n_b, in fp32
    out_h = sum_j softmax(s)_j V_hat_j                       in fp32, cast to q.dtype

The dequantization is exactly :func:`jetrl.fp8.kv_quant.dequantize_kv`, including the one
rounding to the model dtype: the trainer's forward sees K/V dequantized to the model dtype, so
the rollout must too. The kernel (kernels/decode_attention_triton.py) computes the same sums
flash-decoding style. It walks the positions in tiles of BLOCK_S with the online softmax, in
the base-2 domain (``t_j = s_j log2 e``)::

    m' = max(m, max_j t_j);   a = 2^(m - m');   l' = a l + sum_j 2^(t_j - m');
    acc' = a acc + sum_j 2^(t_j - m') V_hat_j;   out = acc / l

and, when the grid ``B * Hkv`` is too small to fill the GPU, splits each row's valid range
into ``num_splits`` chunks whose partials ``(o_i = acc_i / l_i, lse_i = m_i + log2 l_i)`` are
merged in a fixed order: ``out = sum_i 2^(lse_i - M) o_i / sum_i 2^(lse_i - M)``, ``M = max_i lse_i``.

Layout: q (B, H, D); k, v (B, Hkv, S, D) and scales (B, Hkv, S) are read through their strides,
so the cache rows ``k_all[layer, :B]`` of a (L, slots, Hkv, S, D) tensor are passed without a copy.

Numerics: products of two model-dtype values are exact in fp32, so the kernel differs from the
reference only in fp32 summation order (and, in the kernel's P @ V, in splitting each fp32
probability into two model-dtype terms: relative error ~2^-16). Expect outputs within one or two
ulps of q.dtype (bf16: ~1e-2 absolute on O(1) outputs). Positions beyond ``lengths[b]`` are stale
and may hold NaN/Inf: both implementations select them away (``where``), never multiply them by 0.
A length outside [0, S-1] raises when ``lengths`` is on the CPU; on the GPU a check would be a
host sync (CUDA graphs forbid it), so both implementations clamp it into that range instead.

Backend: resolved once per device type -- CUDA with Triton runs the kernel, everything else the
reference -- overridable with ``JETRL_DECODE_ATTENTION=reference|triton`` (read at the first call
on a device type) or, for tests, :func:`use_decode_attention_backend`. Triton is imported lazily.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable

import torch
from torch import Tensor

from jetrl.fp8.kv_quant import dequantize_kv
from jetrl.fp8.quant import BLOCK, E4M3, Float8Blocks, quantize
from jetrl.models.fused import QuantizedOutput
from jetrl.overrides import ScopedOverride, env_choice

MODEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
DECODE_ATTENTION_BACKENDS = ("reference", "triton")


def decode_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lengths: Tensor,
    *,
    k_scales: Tensor | None = None,
    v_scales: Tensor | None = None,
    sm_scale: float | None = None,
) -> Tensor:
    """The spec in plain PyTorch (module docstring): (B, H, D) in q.dtype. Reads all S positions.

    Accumulates in fp32, or in fp64 for an fp32 q: the model's CPU attention does the same
    (models/llama.py), which makes the rounded fp32 result independent of batch composition.
    """
    B, H, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if k.dtype == E4M3:  # the cache's one dequantization: what the trainer's attention sees
        k, v = dequantize_kv(k, k_scales, q.dtype), dequantize_kv(v, v_scales, q.dtype)
    compute = torch.float64 if q.dtype == torch.float32 else torch.float32
    scale = D**-0.5 if sm_scale is None else sm_scale
    last = lengths.clamp(0, S - 1)
    valid = (torch.arange(S, device=q.device)[None, :] <= last[:, None])[:, None, None, :]  # (B, 1, 1, S)
    qg = q.reshape(B, Hkv, H // Hkv, D).to(compute)  # (B, Hkv, G, D): the G query heads of each kv head
    scores = torch.matmul(qg, k.to(compute).transpose(-1, -2)) * scale  # (B, Hkv, G, S)
    probs = torch.softmax(torch.where(valid, scores, float("-inf")), dim=-1)  # stale NaN selected away
    v_valid = torch.where(valid.transpose(-1, -2), v.to(compute), 0.0)  # (B, Hkv, S, D); 0 * NaN never happens
    return torch.matmul(probs, v_valid).reshape(B, H, D).to(q.dtype)


def decode_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lengths: Tensor,
    *,
    k_scales: Tensor | None = None,
    v_scales: Tensor | None = None,
    sm_scale: float | None = None,
    pow2_scales: bool = False,
    row_order: Tensor | None = None,
    quantized: QuantizedOutput | None = None,
) -> Tensor:
    """Attention of each row's pending token over its cached keys ``0..lengths[b]`` (inclusive).

    q (B, H, D) in the model dtype; k, v (B, Hkv, S, D), possibly strided views, in q.dtype or as
    float8_e4m3fn codes with fp32 ``k_scales``/``v_scales`` (B, Hkv, S); lengths (B,) int64;
    ``sm_scale`` defaults to 1/sqrt(D). Returns (B, H, D) in q.dtype. No host sync on the GPU.

    ``pow2_scales=True`` declares that every scale is a power of two (a cache written under a
    ``KVCacheSpec(pow2_scale=True)``, as ``jet_kv``'s); the kernel then keeps the scales out of its dots,
    exact for such scales (kernels/decode_attention_triton.py). The result is the same math either way;
    with other scales the declaration only costs the rounding of ``codes * scale`` to the model
    dtype, so it cannot produce garbage, but it is not faithful to the reference.

    ``row_order`` (B,) int64, a permutation of the rows, e.g. :func:`longest_first` of ``lengths``: the
    order in which the kernel's programs take the rows. It never changes a result (each row's sums are
    the same), only the time: longest first avoids a tail of long rows running alone at the end
    (kernels/decode_attention_triton.py). Checked to be a permutation on the CPU only (a check on the
    GPU would be a host sync); the reference ignores it.

    ``quantized`` (:class:`~jetrl.models.fused.QuantizedOutput`): also write ``quantize(out.reshape(B, H * D))``
    in 1x128 groups -- o_proj's FP8 input -- into these buffers, codes (B, H * D) and scales (B, H * D / 128).
    The kernel does it in its epilogue where that pays (``decode_attention_triton``); anywhere else the
    quantizer runs on the output, with the same result.
    """
    _validate(q, k, v, lengths, k_scales, v_scales, row_order, quantized)
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    if q.shape[0] == 0:
        return torch.empty_like(q)
    backend = decode_attention_backend(q.device)
    impl = _implementation(backend, q.device)
    kw = {"pow2_scales": pow2_scales, "row_order": row_order, "quantized": quantized} if backend == "triton" else {}
    out = impl(q, k, v, lengths, k_scales=k_scales, v_scales=v_scales, sm_scale=sm_scale, **kw)
    if quantized is not None and backend == "reference":
        quantize_output(out, quantized)
    return out


def quantize_output(out: Tensor, quantized: QuantizedOutput) -> None:
    """``quantize(out.reshape(B, H * D))`` in 1x128 groups -- o_proj's FP8 input -- into ``quantized``'s buffers."""
    codes, scales, pow2 = quantized
    quantize(out.reshape(out.shape[0], -1), (1, BLOCK), pow2_scale=pow2, out=Float8Blocks(codes, scales, (1, BLOCK)))


# ---------------------------------------------------------------------------------------
# Backend: one per device type, resolved once; the override is for tests and benches.
_override = ScopedOverride("decode attention backend", DECODE_ATTENTION_BACKENDS)


@functools.cache
def _default_backend(device_type: str) -> str:
    env = env_choice("JETRL_DECODE_ATTENTION", DECODE_ATTENTION_BACKENDS)
    if env is not None:
        return env
    from jetrl.fp8.kernels import has_triton

    return "triton" if device_type == "cuda" and has_triton() else "reference"


def decode_attention_backend(device: torch.device | str) -> str:
    """The implementation :func:`decode_attention` runs on ``device``: "reference" or "triton"."""
    return _override.value or _default_backend(torch.device(device).type)


def use_decode_attention_backend(name: str) -> contextlib.AbstractContextManager[None]:
    """Run :func:`decode_attention` with backend ``name`` inside the block, on every device (tests)."""
    return _override(name)


def _implementation(backend: str, device: torch.device) -> Callable[..., Tensor]:
    if backend == "reference":
        return decode_attention_reference
    from jetrl.fp8.kernels import has_triton

    if not has_triton():
        raise RuntimeError("decode attention backend 'triton' needs Triton: pip install triton, or use 'reference'")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise RuntimeError(
            f"decode attention backend 'triton' needs CUDA tensors, got {device.type}; "
            "set TRITON_INTERPRET=1 (before importing triton) to run the kernel on the CPU"
        )
    from jetrl.engine.kernels.decode_attention_triton import decode_attention_triton

    return decode_attention_triton


def longest_first(lengths: Tensor) -> Tensor:
    """The rows ordered by length, longest first, as ``row_order`` for :func:`decode_attention` (no host sync;
    the engine computes it once per decode step and shares it across layers). The stable descending argsort;
    on CUDA with Triton a counting kernel computes it (kernels/row_order_triton.py: 26.8 µs -> a few)."""
    from jetrl.fp8.kernels import has_triton

    if lengths.is_cuda and has_triton():
        from jetrl.engine.kernels.row_order_triton import longest_first_triton

        return longest_first_triton(lengths)
    return torch.argsort(lengths, descending=True, stable=True)


# ---------------------------------------------------------------------------------------
def _validate(
    q: Tensor, k: Tensor, v: Tensor, lengths: Tensor, k_scales: Tensor | None, v_scales: Tensor | None,
    row_order: Tensor | None = None, quantized: QuantizedOutput | None = None,
) -> None:
    for name, t in (("q", q), ("k", k), ("v", v), ("lengths", lengths)):
        if not isinstance(t, Tensor):
            raise TypeError(f"decode_attention: {name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dtype not in MODEL_DTYPES:
        raise TypeError(f"decode_attention: q must be bfloat16, float16 or float32 (the model dtype), got {q.dtype}")
    if q.dim() != 3 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(
            "decode_attention expects q (B, H, D) -- the single pending token, e.g. q[:, :, 0] of (B, H, 1, D) -- "
            f"and k, v (B, Hkv, S, D) of one shape; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    (B, H, D), (Bk, Hkv, S, Dk) = q.shape, k.shape
    if Bk != B or Dk != D or Hkv == 0 or H % Hkv or S == 0:
        raise ValueError(
            f"decode_attention: q (B={B}, H={H}, D={D}) and k/v (B={Bk}, Hkv={Hkv}, S={S}, D={Dk}) must agree on "
            "B and D, with S >= 1 and H a multiple of Hkv (query head h reads kv head h // (H // Hkv))"
        )
    if lengths.shape != (B,) or lengths.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"decode_attention: lengths must be (B,) = ({B},) int64 (row b attends to 0..lengths[b]), "
            f"got {lengths.dtype} {tuple(lengths.shape)}"
        )
    if row_order is not None:
        if not isinstance(row_order, Tensor) or row_order.shape != (B,) or row_order.dtype not in (torch.int64,
                                                                                                  torch.int32):
            raise ValueError(
                f"decode_attention: row_order must be a (B,) = ({B},) int64 permutation of the rows "
                f"(e.g. longest_first(lengths)), got {getattr(row_order, 'dtype', type(row_order).__name__)} "
                f"{tuple(getattr(row_order, 'shape', ()))}"
            )
        if row_order.device.type == "cpu" and not torch.equal(torch.sort(row_order).values, torch.arange(B)):
            raise ValueError("decode_attention: row_order must be a permutation of 0..B-1 (each row exactly once)")
    if quantized is not None:
        codes, scales, _ = quantized
        width = q.shape[1] * q.shape[2]
        if (width % BLOCK or codes.dtype != E4M3 or codes.shape != (q.shape[0], width) or not codes.is_contiguous()
                or scales.dtype != torch.float32 or scales.shape != (q.shape[0], width // BLOCK)):
            raise ValueError(
                f"decode_attention: quantized must hold contiguous float8_e4m3fn codes ({q.shape[0]}, H * D = {width}) "
                f"and float32 scales ({q.shape[0]}, {width // BLOCK}) with H * D a multiple of {BLOCK} (o_proj's 1x128 "
                f"input); got codes {codes.dtype} {tuple(codes.shape)}, scales {scales.dtype} {tuple(scales.shape)}"
            )
    tensors = (q, k, v, lengths, k_scales, v_scales, row_order, *(quantized[:2] if quantized is not None else ()))
    devices = {t.device for t in tensors if t is not None}
    if len(devices) != 1:
        raise ValueError(f"decode_attention: all tensors must be on one device, got {sorted(map(str, devices))}")
    if k.dtype != v.dtype:
        raise TypeError(f"decode_attention: k and v must share a dtype, got k {k.dtype} and v {v.dtype}")
    if k.dtype == E4M3:
        for name, s in (("k_scales", k_scales), ("v_scales", v_scales)):
            if s is None:
                raise ValueError(f"decode_attention: an FP8 cache needs {name} (B, Hkv, S) fp32; got None")
            if s.dtype != torch.float32 or s.shape != k.shape[:3]:
                raise ValueError(
                    f"decode_attention: {name} must be fp32 {tuple(k.shape[:3])} (one scale per token per kv head), "
                    f"got {s.dtype} {tuple(s.shape)}"
                )
    elif k.dtype == q.dtype:
        if k_scales is not None or v_scales is not None:
            raise ValueError(
                f"decode_attention: k_scales/v_scales are for an FP8 (float8_e4m3fn) cache; this cache is {k.dtype}, "
                "so pass None"
            )
    else:
        raise TypeError(
            f"decode_attention: k/v must be in q's dtype {q.dtype} or float8_e4m3fn codes (view uint8 codes with "
            f".view(torch.float8_e4m3fn)), got {k.dtype}"
        )
    if lengths.device.type == "cpu" and bool(((lengths < 0) | (lengths >= S)).any()):
        raise ValueError(
            f"decode_attention: lengths must lie in [0, S-1] = [0, {S - 1}] (the pending token's K/V sits at "
            f"position lengths[b]), got min {int(lengths.min())}, max {int(lengths.max())}"
        )
