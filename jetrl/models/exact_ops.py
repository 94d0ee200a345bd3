"""The two model ops exact mode (jetrl/exact.py) replaces on CUDA: the high-precision linear layer and attention.

Each has a PyTorch reference (its spec, in fp32) and a batch-invariant Triton kernel with one tile shape for
every problem size (models/kernels/exact_linear_triton.py, exact_attention_triton.py), so a row's result is
the same bits in a decode step and in the trainer's full forward. Both keep autograd:

* linear: y = x W^T + b in the kernel; the backward is the usual BF16 GEMMs, dx = dy W, dW = dy^T x, db = sum dy;
* attention: the kernel's output; the backward is SDPA's gradient at the same inputs (recomputed with
  the native kernel), i.e. the gradient of softmax attention -- the forward's rounding order does not
  belong in a gradient, and no rollout ever sees one.

Arguments outside what the kernels implement (dropout, float masks, a per-head mask, a head_dim that is not
a power of two, a dtype other than bf16/fp16/fp32) raise with the reason: exact mode never falls back silently
to a kernel that is not batch-invariant.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

EXACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # fp32: IEEE products in the dots, not TF32


def exact_linear_reference(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """The spec: ``x W^T + b`` accumulated in fp32, rounded once to x's dtype."""
    out = x.float() @ weight.float().t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def exact_attention_reference(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, causal: bool = False,
                              scale: float | None = None) -> Tensor:
    """The spec: softmax(q k^T * scale) v in fp32 over the keys a row may attend (GQA: query head h reads kv head
    h // (H / Hkv)); a row that may attend nothing gives 0. q (B, H, T, D), k/v (B, Hkv, S, D)."""
    _, H, T, D = q.shape
    G = H // k.shape[1]
    kf, vf = k.float().repeat_interleave(G, dim=1), v.float().repeat_interleave(G, dim=1)
    scores = (q.float() @ kf.transpose(-1, -2)) * (D ** -0.5 if scale is None else scale)
    allowed = torch.ones(T, k.shape[2], dtype=torch.bool, device=q.device)
    if causal:
        allowed = allowed.tril()
    allowed = allowed if mask is None else allowed & mask
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with no key: 0
    vf = vf.masked_fill(~allowed.any(dim=-2)[..., None], 0.0)  # keys no row attends (stale cache: maybe NaN)
    return (probs @ vf).to(q.dtype)


def exact_linear(input: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear`` through the batch-invariant kernel (CUDA, bf16/fp16/fp32)."""
    _check_device(input)
    if input.dtype not in EXACT_DTYPES or weight.dtype != input.dtype or (bias is not None and bias.dtype != input.dtype):
        raise ValueError(
            f"exact mode: the batch-invariant linear layer takes bf16/fp16/fp32 input and parameters of one dtype, got "
            f"input {input.dtype}, weight {weight.dtype}" + ("" if bias is None else f", bias {bias.dtype}")
            + "; cast the model to bf16, or leave exact mode (jetrl.exact.use_exact(False))")
    return _ExactLinear.apply(input, weight, bias)


def exact_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None, dropout_p: float = 0.0,
                    is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> Tensor:
    """``F.scaled_dot_product_attention`` through the batch-invariant kernel (same arguments; see module docstring)."""
    _check_device(query)
    problem = _attention_problem(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    if problem:
        raise ValueError(f"exact mode: the batch-invariant attention cannot run this call: {problem}; leave exact "
                         "mode (jetrl.exact.use_exact(False)) for it")
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    return _ExactAttention.apply(query, key, value, attn_mask, bool(is_causal), scale, bool(enable_gqa))


def exact_cache_attention(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor, k_scales: Tensor | None = None,
                          v_scales: Tensor | None = None) -> Tensor:
    """A decode step's attention over a static KV cache through the same kernel (and binary) as
    :func:`exact_attention`: q (B, H, 1, D), k/v (B, Hkv, S, D) the cache rows in q's dtype, or E4M3 codes with
    fp32 ``k_scales``/``v_scales`` (B, Hkv, S); row b attends keys 0..lengths[b]. Equal bit for bit to
    ``exact_attention(q, deq(k), deq(v), attn_mask=(j <= lengths[b]))``, without materializing the dequantized
    cache or reading past each row's length. No autograd (a rollout)."""
    _check_device(q)
    problem = _cache_problem(q, k, v, lengths, k_scales, v_scales)
    if problem:
        raise ValueError(f"exact mode: the batch-invariant attention cannot run this decode step: {problem}")
    from jetrl.models.kernels.exact_attention_triton import exact_attention_triton

    return exact_attention_triton(q, k, v, None, False, q.shape[-1] ** -0.5, lengths=lengths, k_scales=k_scales,
                                  v_scales=v_scales)


def _check_device(x: Tensor) -> None:
    from jetrl.fp8.kernels import capability, has_triton
    from jetrl.models.fused import FUSED_MIN_CAPABILITY, fused_ops_requested

    if not has_triton():
        raise RuntimeError("exact mode needs Triton for its batch-invariant kernels: pip install triton")
    if capability(x.device) < FUSED_MIN_CAPABILITY:
        raise RuntimeError(f"exact mode needs an SM89+ GPU (FP8 tensor cores), got sm_{''.join(map(str, capability(x.device)))}")
    if not fused_ops_requested():
        raise RuntimeError("exact mode needs the fused RMSNorm/SwiGLU/logprob kernels (batch-invariant by "
                           "construction); unset JETRL_FUSED_OPS=0 / use_fused_ops(False)")


def _attention_problem(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float, causal: bool,
                       enable_gqa: bool) -> str | None:
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        return f"q (B, H, T, D) and k/v (B, Hkv, S, D) expected, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
    B, H, T, D = q.shape
    if k.shape[0] != B or k.shape[3] != D or H % k.shape[1] or (H != k.shape[1] and not enable_gqa):
        return f"shapes q {tuple(q.shape)} and k {tuple(k.shape)} do not pair (GQA needs enable_gqa=True)"
    if q.dtype not in EXACT_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtypes {q.dtype}/{k.dtype}/{v.dtype}; bf16, fp16 or fp32, one dtype"
    if D < 16 or D & (D - 1):
        return f"head_dim {D} is not a power of two >= 16"
    if dropout_p:
        return f"dropout_p={dropout_p}"
    if causal and (mask is not None or T != k.shape[2]):  # SDPA refuses both too
        return "is_causal with a mask or with T != S"
    if mask is not None and (mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1
                             or mask.shape[0] not in (1, B) or mask.shape[2] not in (1, T) or mask.shape[3] != k.shape[2]):
        return f"attn_mask must be bool (B|1, 1, T|1, S), got {mask.dtype} {tuple(mask.shape)}"
    return None


def _cache_problem(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor, k_scales: Tensor | None,
                   v_scales: Tensor | None) -> str | None:
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        return f"q (B, H, 1, D) and k/v (B, Hkv, S, D) expected, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
    B, H, T, D = q.shape
    if T != 1 or k.shape[0] != B or k.shape[3] != D or H % k.shape[1]:
        return f"shapes q {tuple(q.shape)} and k {tuple(k.shape)} are not one decode query per row over its cache"
    if D < 16 or D & (D - 1):
        return f"head_dim {D} is not a power of two >= 16"
    if lengths.dtype != torch.int64 or lengths.shape != (B,):
        return f"lengths must be int64 ({B},), got {lengths.dtype} {tuple(lengths.shape)}"
    if q.dtype not in EXACT_DTYPES:
        return f"q dtype {q.dtype}; bf16, fp16 or fp32"
    if k_scales is None:
        return None if k.dtype == v.dtype == q.dtype else f"a model-dtype cache in q's dtype {q.dtype}, got {k.dtype}"
    if (k.dtype not in (torch.uint8, torch.float8_e4m3fn) or v.dtype != k.dtype or v_scales is None
            or k_scales.dtype != torch.float32 or v_scales.dtype != torch.float32
            or k_scales.shape != k.shape[:3] or v_scales.shape != k.shape[:3]):
        return (f"an FP8 cache needs E4M3 codes (B, Hkv, S, D) and fp32 scales (B, Hkv, S) for K and V, got {k.dtype} "
                f"{tuple(k.shape)} with scales {tuple(k_scales.shape)}, {None if v_scales is None else tuple(v_scales.shape)}")
    return None


class _ExactLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        from jetrl.models.kernels.exact_linear_triton import exact_linear_triton

        x2d = x.reshape(-1, x.shape[-1])
        out = exact_linear_triton(x2d, weight, bias)  # the kernel takes its operands contiguous and aligned
        ctx.save_for_backward(x2d, weight)
        ctx.has_bias, ctx.x_shape = bias is not None, x.shape
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: Tensor):
        x2d, weight = ctx.saved_tensors
        g = grad.reshape(-1, weight.shape[0])
        grad_x = (g @ weight).view(ctx.x_shape) if ctx.needs_input_grad[0] else None
        grad_w = g.t() @ x2d if ctx.needs_input_grad[1] else None
        grad_b = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


class _ExactAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, causal, scale, enable_gqa):
        from jetrl.models.kernels.exact_attention_triton import exact_attention_triton

        out = exact_attention_triton(q, k, v, mask, causal, scale)  # it takes q/k/v contiguous and aligned
        ctx.save_for_backward(q, k, v, *(() if mask is None else (mask,)))
        ctx.causal, ctx.scale, ctx.enable_gqa, ctx.has_mask = causal, scale, enable_gqa, mask is not None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        from jetrl.exact import use_exact

        q, k, v, *rest = ctx.saved_tensors
        inputs = [t.detach().requires_grad_(need) for t, need in zip((q, k, v), ctx.needs_input_grad[:3])]
        with use_exact(False), torch.enable_grad():  # SDPA's own gradient, at the same inputs
            out = F.scaled_dot_product_attention(*inputs, attn_mask=rest[0] if ctx.has_mask else None,
                                                 is_causal=ctx.causal, scale=ctx.scale, enable_gqa=ctx.enable_gqa)
            wanted = [t for t in inputs if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad_out) if wanted else ())
        return (*(next(grads) if t.requires_grad else None for t in inputs), None, None, None, None)

