"""FP8 K/V: the one quantize/dequantize pair that the trainer's attention and the engine's cache share.

Why: at RL batch sizes the KV cache, not the weights, dominates decode bytes (design.md §5), so
the rollout wants an FP8 cache. Frameworks that add one keep BF16 training and are off-policy
again. Here the trainer's forward applies the *identical* quantize->dequantize to K and V at the
point where the engine writes its cache (the model's KV hook, after k-norm and RoPE), so the
rollout's graph stays a subgraph of the training forward (``jet_kv`` in recipe.py).

Format (a :class:`~jetrl.fp8.recipe.KVCacheSpec`): E4M3 codes and one fp32 scale per token per
KV head. For K of shape (B, Hkv, T, D) the groups are the D-vectors ``K[b, h, t, :]``:

    q, s     = quantize(K.reshape(-1, D), block=(1, D))      the one quantizer (quant.py):
                                                              s = max(amax / 448, 2^-126) per group
    codes    (B, Hkv, T, D) float8_e4m3fn,  scales (B, Hkv, T) fp32
    K_hat    = cast_dtype(float32(codes) * scales[..., None])  dequantization, then ONE rounding
                                                              to the model dtype

The dequantization is the spec both sides follow: the product is one IEEE fp32 multiply (a
4-bit significand times an fp32 scale; exact with power-of-two scales), then a cast to the
model dtype (a no-op in fp32, round-to-nearest-even in BF16). A fused decode kernel must
produce the same K_hat, or compute its dot products from codes and scales in fp32 and accept
the rounding difference of skipping the model-dtype cast. No scale is calibrated: it is
computed from each token's own K/V when they are written, so nothing drifts between steps.

Memory: D bytes of codes plus 4 bytes of scale per token-head, i.e. (D + 4) / (2 D) of a BF16
cache: 0.52x at D = 128 (the scales add 3% to the codes), 0.53x at D = 64 (6%).

Training: the straight-through estimator (STE). The trainer sees

    K_hat = deq(q(K))        forward: exactly the values the engine's cache returns
    dL/dK := dL/dK_hat       backward: identity

Why STE: ``q`` is piecewise constant (round-to-nearest of x / s), so its derivative is zero
almost everywhere and undefined at the rounding boundaries; the true gradient would stop all
learning of W_k, W_v (and everything below them through K and V). STE differentiates the
quantized forward with respect to the pre-quantization K/V as if q were the identity, the
standard quantization-aware-training choice (Bengio et al. 2013; Jacob et al. 2018). The
gradient is that of the graph the rollout samples from, evaluated at the quantized K_hat, and
it stays in the model dtype (BF16 between ops, as design.md §4 requires): no FP8 gradient is
introduced, so the backward through attention is unchanged. The path through the group's scale
(amax) is dropped as well: the whole map x -> deq(q(x)) is treated as the identity.

NaN/Inf follow quant.py's policy: a token-head group holding a NaN or an Inf gets scale NaN and
NaN codes, so the non-finite value propagates into attention (and the loss) instead of
saturating silently to +-448; the trainer's non-finite-step guard then acts on it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from jetrl.fp8.kernels import KERNEL_FLOAT_DTYPES
from jetrl.fp8.quant import E4M3, Float8Blocks, quant_backend, quantize, record, recording
from jetrl.fp8.recipe import KVCacheSpec, Recipe, current_phase


def kv_names(layer_idx: int) -> tuple[str, str]:
    """The quantizer names of layer ``layer_idx``'s K and V, the same in the trainer and the engine."""
    return f"layers.{layer_idx}.k", f"layers.{layer_idx}.v"


def quantize_kv(x: Tensor, *, pow2_scale: bool = False, name: str = "kv") -> Float8Blocks:
    """E4M3 codes and per-token-head scales of ``x`` (..., D): ``quantize(x.reshape(-1, D), (1, D))``.

    The result's codes are (N, D) and scales (N, 1), N = x.numel() // D, in ``x``'s row-major
    order; reshape with ``codes.view(x.shape)`` and ``scales.view(x.shape[:-1])``.
    """
    if x.dim() < 2:
        raise ValueError(f"{name}: quantize_kv expects (..., head_dim) K/V, got shape {tuple(x.shape)}")
    head_dim = x.shape[-1]
    return quantize(x.reshape(-1, head_dim), (1, head_dim), pow2_scale=pow2_scale, name=name)


def dequantize_kv(codes: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """``float32(codes) * scales[..., None]``, cast to ``dtype``: codes (..., D) e4m3, scales (...) fp32."""
    if codes.dtype != E4M3 or scales.dtype != torch.float32 or codes.shape[:-1] != scales.shape:
        raise ValueError(
            f"dequantize_kv needs float8_e4m3fn codes (..., D) and fp32 scales (...), got {codes.dtype} "
            f"{tuple(codes.shape)} and {scales.dtype} {tuple(scales.shape)}"
        )
    return (codes.float() * scales.unsqueeze(-1)).to(dtype)


def _one_pass(x: Tensor) -> bool:
    """Whether deq(q(x)) runs as the one Triton pass (quant_triton.quantize_dequantize_triton): CUDA with the
    Triton quantizer, a kernel dtype, 2-4 dims, a head width the kernel takes."""
    if not (x.is_cuda and 2 <= x.dim() <= 4 and x.numel() and x.dtype in KERNEL_FLOAT_DTYPES):
        return False
    if quant_backend(x.device) != "triton":
        return False
    from jetrl.fp8.kernels.quant_triton import GROUP_WIDTHS

    return x.shape[-1] in GROUP_WIDTHS


def quantize_dequantize_kv(x: Tensor, *, pow2_scale: bool = False, name: str = "kv") -> Tensor:
    """deq(q(x)) in ``x.dtype``: what an FP8 cache returns for ``x`` (no autograd; see fake_quantize_kv).

    On CUDA one Triton pass (quant_triton.quantize_dequantize_triton: the quantizer's own row
    arithmetic, then the decode above) in x's own layout; elsewhere, or for shapes it does not take,
    quantize_kv then dequantize_kv. Both give the same bits, and the recorders see the same codes."""
    if _one_pass(x):
        from jetrl.fp8.kernels.quant_triton import quantize_dequantize_triton

        out, codes, scales = quantize_dequantize_triton(x, pow2_scale, with_codes=recording())
        if codes is not None:
            record(name, Float8Blocks(codes, scales, (1, x.shape[-1])))
        return out
    q = quantize_kv(x, pow2_scale=pow2_scale, name=name)
    return dequantize_kv(q.codes.view(x.shape), q.scales.view(x.shape[:-1]), x.dtype)


def store_quantized_kv(x: Tensor, codes: Tensor, scales: Tensor, slots: Tensor, *, pow2_scale: bool = False,
                       name: str = "kv") -> Tensor:
    """A KV cache's prefill write: q(x)'s codes and scales stored at ``[slots[i], :, :T]`` of one layer's buffers,
    and deq(q(x)) returned -- what attention must read, equal bit for bit to :func:`quantize_dequantize_kv` (x).

    x is (B, Hkv, T, D); ``codes`` (slots, Hkv, max_len, D) uint8 and ``scales`` (slots, Hkv, max_len) fp32 are
    the cache's buffers, ``slots`` (B,) int64 on x's device. On CUDA one Triton pass (the quantize->dequantize
    kernel writing the codes into the cache); elsewhere, or while a recorder is open (it wants the codes
    as a tensor), :func:`quantize_kv`, :func:`dequantize_kv` and indexed stores, with the same bits."""
    if _one_pass(x) and x.dim() == 4 and not recording():
        from jetrl.fp8.kernels.quant_triton import quantize_dequantize_triton

        return quantize_dequantize_triton(x, pow2_scale, into=(codes, scales, slots))[0]
    q = quantize_kv(x, pow2_scale=pow2_scale, name=name)
    q_codes, q_scales = q.codes.view(x.shape), q.scales.view(x.shape[:-1])
    codes[slots, :, :x.shape[2]] = q_codes.view(torch.uint8)
    scales[slots, :, :x.shape[2]] = q_scales
    return dequantize_kv(q_codes, q_scales, x.dtype)


class _FakeQuantizeKV(torch.autograd.Function):
    """forward: deq(q(x)) in x.dtype; backward: identity (straight-through, module docstring)."""

    @staticmethod
    def forward(ctx, x: Tensor, pow2_scale: bool, name: str) -> Tensor:
        return quantize_dequantize_kv(x, pow2_scale=pow2_scale, name=name)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None, None


def fake_quantize_kv(x: Tensor, *, pow2_scale: bool = False, name: str = "kv") -> Tensor:
    """Differentiable FP8 K/V for the trainer: the cache's values forward, a straight-through gradient."""
    return _FakeQuantizeKV.apply(x, pow2_scale, name)


class KVQuant:
    """The FP8 KV transform of one attention layer, installed as ``Attention.kv_quant`` by
    :func:`jetrl.fp8.convert_to_float8` (the model itself keeps ``kv_quant = None``).

    Phase-aware like Float8Linear: called with this forward's K/V (B, Hkv, T, D) when no KV cache
    is attached, it fake-quantizes them if the recipe's KV op of the current phase is FP8 and
    returns them unchanged otherwise. With a cache attached the cache owns the format (the engine
    builds an FP8 cache exactly when the recipe's rollout KV op is FP8) and this is not called.
    """

    def __init__(self, recipe: Recipe, layer_idx: int) -> None:
        self.recipe, self.layer_idx = recipe, layer_idx
        self.names = kv_names(layer_idx)

    def spec(self) -> KVCacheSpec | None:
        return self.recipe.kv_cache(current_phase())

    def __call__(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        spec = self.spec()
        if spec is None:
            return k, v
        k_name, v_name = self.names
        return (fake_quantize_kv(k, pow2_scale=spec.pow2_scale, name=k_name),
                fake_quantize_kv(v, pow2_scale=spec.pow2_scale, name=v_name))

    def __repr__(self) -> str:
        return f"KVQuant(recipe={self.recipe.name}, layer={self.layer_idx})"
