"""RMSNorm, RoPE and SwiGLU (and their fusions: residual add + RMSNorm, q/k-norm + RoPE) as functions
with a PyTorch reference (the spec) and a fused Triton kernel.

Why: the decoder calls these on every layer; on a GPU at decode sizes each eager op is its own
launch-bound kernel (docs/benchmarks.md, section d). The fused Triton kernels
(:mod:`jetrl.models.kernels.fused_triton`) do each in one launch. The references below are the
model's math, unchanged; they run on CPU always, and on CUDA when the fused path is off.

Backend: fused on CUDA with Triton by default; ``JETRL_FUSED_OPS=0`` turns it off, and
``use_fused_ops(flag)`` overrides both inside a block (in-process, for tests and the bench). The same
switch governs the trainer's fused chosen-token logprobs (jetrl/rl/token_logprobs.py).
``jetrl bench`` section (d) times the decode step both ways; the kernels are tested against the
references under ``TRITON_INTERPRET=1`` on CPU and on the GPU by tests/test_fused_ops.py.

The trainer and the engine call the same function, so with the fused path on both sides see
the same kernel (RoPE is bit-identical to the reference anyway; RMSNorm differs from it only in
the order of its row sum, and is batch-invariant: a row's result does not depend on the batch).

Backward: fused Triton kernels too (:mod:`jetrl.models.kernels.fused_backward_triton`; RoPE's is
its forward kernel run on the gradient), one launch per op, with autograd through the reference
as their spec. They are not optional extras: an H200 profile of one training update (8-layer
8B-shaped Qwen3, 2 micro-batches of 8 x 1152 tokens) spent ~280 of 585 ms outside the GEMMs
(aten::mul 69 ms in 865 kernels, aten::copy_ 36-47 ms, add_/sum/pow/mean/cat/silu_backward ~40 ms
more), much of it autograd re-running these references in fp32 -- ~10 full-tensor passes per op,
4 RMSNorms per layer. RoPE's gradient is bit-identical to the reference's autograd, SwiGLU's
mirrors its roundings (equal up to fp32 contraction), RMSNorm's differs in fp32 ordering only
(its grad_weight is summed per program, then over programs: deterministic, no atomics).
Autograd through the reference remains the path on CPU, with the fused ops off, and for rows
too wide for the RMSNorm backward kernel (over 8192).
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from jetrl.fp8.kernels import KERNEL_FLOAT_DTYPES
from jetrl.overrides import ScopedOverride, env_choice

_ENV = "JETRL_FUSED_OPS"


class QuantizedOutput(NamedTuple):
    """Buffers for an op's output quantized in 1x128 groups along its last dim by the quantizer's own arithmetic:
    ``codes`` (rows, cols) contiguous E4M3, ``scales`` (rows, cols / 128) fp32 of any strides, ``pow2``:
    power-of-two scales; cols a multiple of 128."""

    codes: Tensor
    scales: Tensor
    pow2: bool


class OutputQuant(Protocol):
    """What the model's ``output_quant`` (RMSNorm, Attention) and ``act_quant`` (MLP) slots hold: None in the
    pure model; the FP8 transform installs jetrl.fp8.producer_quant.ProducerQuant, which asks the fused kernel
    producing a linear layer's input to write its FP8 codes too (the fused path without autograd only;
    elsewhere the slot is ignored and the layer quantizes its input itself, with the same result)."""

    def buffers(self, rows: int, cols: int, device: torch.device) -> QuantizedOutput | None:
        """Where to write the codes for an output of (rows, cols), or None: the consumer quantizes itself."""

    def publish(self, out: Tensor, quantized: QuantizedOutput) -> None:
        """Hand the written codes of ``out`` (the very tensor the consumer will read) to the consumer."""


def _quantized(quant: OutputQuant | None, x: Tensor) -> QuantizedOutput | None:
    return None if quant is None else quant.buffers(x.numel() // x.shape[-1], x.shape[-1], x.device)


def published(out: Tensor, quant: OutputQuant | None, quantized: QuantizedOutput | None) -> Tensor:
    """``out``, after handing the codes written for it (if any) to its consumer: ``quant.publish``."""
    if quantized is not None:
        quant.publish(out, quantized)
    return out


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``weight * (x / sqrt(mean(x^2) + eps))``: computed in fp32, cast back to x's dtype before ``* weight``."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def silu_mul_reference(gate: Tensor, up: Tensor) -> Tensor:
    """SwiGLU's gating: ``silu(gate) * up``, each op rounded to the model dtype."""
    return F.silu(gate) * up


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope_reference(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: (B, H, T, D); cos/sin: (B|1, T, D). HF's half-split convention."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


_override = ScopedOverride("fused-ops setting", (True, False))


def fused_ops_requested() -> bool:
    """Whether the fused path is asked for: the innermost :func:`use_fused_ops`, else ``JETRL_FUSED_OPS``."""
    if _override.value is not None:
        return _override.value
    flag = env_choice(_ENV, ("0", "1"), "1 = fused RMSNorm/RoPE/SwiGLU/logprob kernels on CUDA, the default; 0 = PyTorch ops")
    return flag != "0"


def fused_ops_enabled(x: Tensor) -> bool:
    """True if ``x``'s op runs the fused kernel: requested, ``x`` on CUDA, Triton installed, and a GPU that compiles
    the kernels (``FUSED_MIN_CAPABILITY``)."""
    if not (fused_ops_requested() and x.is_cuda):
        return False
    from jetrl.fp8.kernels import capability, has_triton

    # SM89+ (Ada, Hopper and later): the norms' and SwiGLU's FP8 epilogue is compiled into every call (one binary
    # with and without it, fused_triton.py), and Triton has no E4M3 conversion below sm_89, so on an A100 the
    # model's ops run as PyTorch ops instead of failing to compile
    return has_triton() and capability(x.device) >= FUSED_MIN_CAPABILITY


FUSED_MIN_CAPABILITY = (8, 9)


def use_fused_ops(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """Turn the fused path on or off inside the block (in this process only; tests, the bench).

    The engine keys its CUDA graphs on this setting, so toggling it between generate calls
    recaptures rather than replaying graphs of the other path.
    """
    return _override(bool(enabled))


def rms_norm(x: Tensor, weight: Tensor, eps: float, quant: OutputQuant | None = None) -> Tensor:
    """``quant``: see :class:`OutputQuant` (the fused path without autograd writes the output's FP8 codes too)."""
    if not fused_ops_enabled(x):
        return rms_norm_reference(x, weight, eps)
    from jetrl.models.kernels.fused_triton import rms_norm_triton

    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _FusedRMSNorm.apply(x, weight, eps)
    quantized = _quantized(quant, x)
    return published(rms_norm_triton(x, weight, eps, quantized), quant, quantized)


def add_rms_norm(x: Tensor, delta: Tensor, weight: Tensor, eps: float,
                 quant: OutputQuant | None = None) -> tuple[Tensor, Tensor]:
    """``h = x + delta`` and ``rms_norm(h, weight, eps)``: a residual add and the norm that reads it, one
    kernel on the fused path (the reference: the two ops). ``quant``: as in :func:`rms_norm`, for the norm."""
    if (not fused_ops_enabled(x) or x.shape != delta.shape or x.dtype != delta.dtype
            or x.dtype not in KERNEL_FLOAT_DTYPES or weight.dtype not in KERNEL_FLOAT_DTYPES):
        h = x + delta
        return h, rms_norm(h, weight, eps, quant)
    from jetrl.models.kernels.fused_triton import add_rms_norm_triton

    if torch.is_grad_enabled() and (x.requires_grad or delta.requires_grad or weight.requires_grad):
        return _FusedAddRMSNorm.apply(x, delta, weight, eps)
    quantized = _quantized(quant, x)
    h, y = add_rms_norm_triton(x, delta, weight, eps, quantized)
    return h, published(y, quant, quantized)


def norm_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, q_norm: Any = None,
              k_norm: Any = None) -> tuple[Tensor, Tensor]:
    """Attention's q (B, T, Hq, D) and k (B, T, Hk, D) -> per-head RMSNorm (the ``q_norm``/``k_norm``
    modules, Qwen3; skipped when None) -> RoPE, returned as (B, H, T, D). One kernel for all of it on
    the fused path; the reference is the ops one by one (``rms_norm``, ``apply_rope``). The fused path
    reads the norm modules' ``weight`` and ``eps`` and does not call them, so forward hooks on
    ``q_norm``/``k_norm`` fire on the reference path only (as for ``RMSNorm.add_forward``)."""
    norm = q_norm is not None
    half = q.shape[-1] // 2
    weights = (q_norm.weight, k_norm.weight) if norm else (None, None)
    if (fused_ops_enabled(q) and q.shape[-1] % 2 == 0 and not half & (half - 1) and q.dtype in KERNEL_FLOAT_DTYPES
            and q.dtype == k.dtype == cos.dtype == sin.dtype
            and (not norm or (q_norm.eps == k_norm.eps and weights[0].dtype == weights[1].dtype == q.dtype))):
        from jetrl.models.kernels.fused_triton import norm_rope_triton

        eps = q_norm.eps if norm else 0.0
        tensors = (q, k, *weights) if norm else (q, k)
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            return _FusedNormRoPE.apply(q, k, *weights, eps, cos, sin)
        return norm_rope_triton(q, k, *weights, eps, cos, sin)
    if norm:
        q, k = q_norm(q), k_norm(k)
    return apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    if not fused_ops_enabled(x) or x.shape[-1] % 2 or half & (half - 1) or not (x.dtype == cos.dtype == sin.dtype):
        return apply_rope_reference(x, cos, sin)  # shapes/dtypes the kernel does not take: the reference
    from jetrl.models.kernels.fused_triton import apply_rope_triton

    if torch.is_grad_enabled() and x.requires_grad:
        return _FusedRoPE.apply(x, cos, sin)
    return apply_rope_triton(x, cos, sin)


def silu_mul(gate: Tensor, up: Tensor, quant: OutputQuant | None = None) -> Tensor:
    """``silu(gate) * up``. ``quant``: as in :func:`rms_norm`."""
    if not fused_ops_enabled(gate) or gate.shape != up.shape or gate.dtype != up.dtype:
        return silu_mul_reference(gate, up)
    from jetrl.models.kernels.fused_triton import silu_mul_triton

    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _FusedSiluMul.apply(gate, up)
    quantized = _quantized(quant, gate)
    return published(silu_mul_triton(gate, up, quantized), quant, quantized)


class _FusedSiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        from jetrl.models.kernels.fused_triton import silu_mul_triton

        ctx.save_for_backward(gate, up)
        return silu_mul_triton(gate, up)

    @staticmethod
    def backward(ctx, grad):
        from jetrl.models.kernels.fused_backward_triton import silu_mul_backward_triton

        gate, up = ctx.saved_tensors
        grad_gate, grad_up = silu_mul_backward_triton(gate, up, grad)
        return (grad_gate if ctx.needs_input_grad[0] else None), (grad_up if ctx.needs_input_grad[1] else None)


class _FusedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        from jetrl.models.kernels.fused_triton import rms_norm_triton

        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return rms_norm_triton(x, weight, eps)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return (*_rms_norm_grads(x, weight, ctx.eps, grad, *ctx.needs_input_grad[:2]), None)


class _FusedAddRMSNorm(torch.autograd.Function):
    """(h, y) = (x + delta, rms_norm(h)); grad_x = grad_delta = grad_h + the norm's grad wrt h, the sum
    autograd forms for h's two uses in the unfused graph (added inside the norm's backward kernel)."""

    @staticmethod
    def forward(ctx, x, delta, weight, eps):
        from jetrl.models.kernels.fused_triton import add_rms_norm_triton

        h, y = add_rms_norm_triton(x, delta, weight, eps)
        ctx.save_for_backward(h, weight)
        ctx.eps = eps
        return h, y

    @staticmethod
    def backward(ctx, grad_h, grad_y):
        h, weight = ctx.saved_tensors
        need_x, need_delta, need_w = ctx.needs_input_grad[:3]
        grad_w = None
        if grad_y is not None:
            grad_h, grad_w = _rms_norm_grads(h, weight, ctx.eps, grad_y, need_x or need_delta, need_w,
                                             residual_grad=grad_h)
        return (grad_h if need_x else None), (grad_h if need_delta else None), grad_w, None


class _FusedNormRoPE(torch.autograd.Function):
    """norm_rope_triton with weights; backward: RoPE's backward kernel, then RMSNorm's."""

    @staticmethod
    def forward(ctx, q, k, q_weight, k_weight, eps, cos, sin):
        from jetrl.models.kernels.fused_triton import norm_rope_triton

        # RoPE alone is linear in q and k: its gradient needs cos and sin only, so q and k are kept
        # only when the norms need them
        ctx.save_for_backward(*((q, k, q_weight, k_weight) if q_weight is not None else (None,) * 4), cos, sin)
        ctx.eps = eps
        return norm_rope_triton(q, k, q_weight, k_weight, eps, cos, sin)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        from jetrl.models.kernels.fused_triton import apply_rope_backward_triton

        q, k, q_weight, k_weight, cos, sin = ctx.saved_tensors
        needs = ctx.needs_input_grad
        grads = [None] * 7
        for i, (x, weight, grad) in enumerate(((q, q_weight, grad_q), (k, k_weight, grad_k))):
            if grad is None or not (needs[i] or needs[2 + i]):
                continue
            grad = apply_rope_backward_triton(grad, cos, sin).transpose(1, 2)  # wrt the normed (B, T, H, D)
            if weight is None:
                grads[i] = grad
            else:
                grads[i], grads[2 + i] = _rms_norm_grads(x, weight, ctx.eps, grad, needs[i], needs[2 + i])
        return tuple(grads)


class _FusedRoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        from jetrl.models.kernels.fused_triton import apply_rope_triton

        ctx.save_for_backward(cos, sin)  # RoPE is linear in x: its gradient does not need x
        return apply_rope_triton(x, cos, sin)

    @staticmethod
    def backward(ctx, grad):
        from jetrl.models.kernels.fused_triton import apply_rope_backward_triton

        cos, sin = ctx.saved_tensors
        return apply_rope_backward_triton(grad, cos, sin), None, None


def _rms_norm_grads(x: Tensor, weight: Tensor, eps: float, grad: Tensor, need_x: bool, need_w: bool,
                    residual_grad: Tensor | None = None) -> tuple[Tensor | None, Tensor | None]:
    """(grad_x, grad_weight) of ``rms_norm_reference(x, weight, eps)``: the backward kernel, or autograd
    through the reference for rows too wide for it. ``residual_grad``: a second gradient of x (None: none), added
    to grad_x -- in the kernel when it can (same shape and dtype as x), else by PyTorch; returned as grad_x alone
    when grad_x itself is not needed."""
    from jetrl.models.kernels.fused_backward_triton import RMS_NORM_BACKWARD_MAX_COLS, rms_norm_backward_triton

    wide = x.shape[-1] > RMS_NORM_BACKWARD_MAX_COLS  # too wide for one row in registers: the reference
    fused = (need_x and not wide and residual_grad is not None and residual_grad.shape == x.shape
             and residual_grad.dtype == x.dtype)
    if wide:
        grad_x, grad_w = _reference_grads(lambda a, w: rms_norm_reference(a, w, eps), (x, weight), grad, (need_x, need_w))
    else:
        grad_x, grad_w = rms_norm_backward_triton(x, weight, eps, grad, need_weight_grad=need_w,
                                                  residual_grad=residual_grad if fused else None)
        grad_x = grad_x if need_x else None
    if fused or residual_grad is None:
        return grad_x, grad_w
    return (residual_grad if grad_x is None else grad_x + residual_grad), grad_w


def _reference_grads(fn, inputs: tuple[Tensor, ...], grad: Tensor, needed: tuple[bool, ...]) -> list[Tensor | None]:
    """Gradients of ``fn(*inputs)`` against ``grad`` for the ``needed`` inputs, by autograd on the reference."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(need) for t, need in zip(inputs, needed)]
        out = fn(*leaves)
        wanted = [leaf for leaf, need in zip(leaves, needed) if need]
        grads = iter(torch.autograd.grad(out, wanted, grad)) if wanted else iter(())
    return [next(grads) if need else None for need in needed]
