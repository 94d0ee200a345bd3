"""Float8Linear: a drop-in ``nn.Linear`` whose three GEMMs run in block FP8.

One ``autograd.Function`` holds the whole layer (y = x W^T; M tokens, K in, N out):

    fprop  Y[M,N]  = q(X)[M,K] . q(W)[N,K]^T        X 1x128 along K, W 128x128 (cached)
    dgrad  dX[M,K] = q(dY)[M,N] . q(W)^T[K,N]^T     dY 1x128 along N, W^T from the same codes
    wgrad  dW[N,K] = q(dY^T)[N,M] . q(X^T)[K,M]^T   both operands 1x128 along tokens M

* The input is saved for backward in FP8, already in the wgrad layout (X^T codes + scales,
  1 byte/element); the BF16 input is not kept.
* X and dY are each quantized in one pass that writes both of their layouts
  (:func:`~jetrl.fp8.quant.quantize_with_transpose`): two activation passes per layer
  and step instead of four.
* Gradients between ops stay in the input's dtype (BF16 in a BF16 model), dW is accumulated
  in fp32 by the GEMM and returned in the master weight's dtype (BF16, or fp32 if chosen).
* The bias is added outside the Function in high precision, by autograd.
* Sibling layers that read the same input tensor -- q/k/v of one attention, gate/up of one MLP --
  quantize it once (input_memo.py: a hit is the same tensor object, unmodified, with the same spec;
  the codes are those a fresh call would produce). In training they also save one X^T for their
  three (two) wgrads: per layer and micro-batch, 4 passes over inputs instead of 7, and 3 fewer
  saved copies of X^T. On CUDA such siblings also run as one GEMM over their stacked weight codes
  (projection_group.py): without autograd (the rollout, old-logprob passes) with no Function at all,
  in training as one Function (``_StackedFloat8LinearFn``) whose backward is one dgrad and one wgrad.

Which precision a call uses comes from the module's :class:`~jetrl.fp8.recipe.Recipe` and
the current phase (``precision_phase("rollout")`` in the engine): under ``jet`` both phases
run this same FP8 forward on the same cached weight codes; under ``fp8_rollout`` training
runs a plain BF16 ``F.linear`` and only the rollout is FP8.

Why not a tensor subclass: one Function is enough, and keeps the data flow readable
(nanochat and torchao's own comparison).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from jetrl.fp8.gemm import fp8_gemm
from jetrl.fp8.input_memo import InputMemo
from jetrl.fp8.quant import BLOCK, Float8Blocks, quantize, quantize_columns_with_transpose, quantize_with_transpose
from jetrl.fp8.recipe import LinearPrecision, QuantSpec, Recipe, current_phase
from jetrl.fp8.weight_cache import WeightCache

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class _Float8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, cache: WeightCache, spec: LinearPrecision, name: str,
                x_both: tuple[Float8Blocks, Float8Blocks] | None):
        """``x_both``: X's two layouts (fprop's, and wgrad's X^T, which is saved) when wgrad will run, from
        Float8Linear.forward, which shares them among siblings; None quantizes X for fprop only."""
        w_q = cache.get(weight, spec.weight)
        ctx.cache, ctx.spec, ctx.name, ctx.x_dtype = cache, spec, name, x2d.dtype
        if x_both is not None:
            x_q, xt_q = x_both
            ctx.save_for_backward(weight, xt_q.codes, xt_q.scales)  # X^T (K, M) in FP8
        else:
            x_q = _quantize(x2d, spec.input, f"{name}.input")
            ctx.save_for_backward(weight)
        return fp8_gemm(x_q, w_q, out_dtype=x2d.dtype)  # (M, N)

    @staticmethod
    def backward(ctx, grad_y):
        spec, name = ctx.spec, ctx.name
        weight, *saved = ctx.saved_tensors
        grad_y = grad_y.contiguous()  # (M, N)
        grad_x = grad_w = None
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if need_dw and not saved:
            raise RuntimeError(f"{name}: wgrad needs the FP8 input saved in forward; run forward with grad enabled")
        gname = f"{name}.grad_output"
        if need_dx and need_dw:
            dy_q, dyt_q = _quantize_both(grad_y, spec.grad_output, spec.wgrad, gname)  # one pass on CUDA
        else:
            dy_q = _quantize(grad_y, spec.grad_output, gname) if need_dx else None
            dyt_q = _quantize(grad_y.t(), spec.wgrad, f"{gname}_t") if need_dw else None
        if need_dx:
            wt_q = ctx.cache.get_transposed(weight, spec.weight)  # (K, N)
            grad_x = fp8_gemm(dy_q, wt_q, out_dtype=ctx.x_dtype, batch_invariant=False)  # (M, K)
        if need_dw:
            xt_q = Float8Blocks(saved[0], saved[1], spec.wgrad.block)
            # fp32 accumulation, rounded once to the master weight's dtype by the GEMM itself
            grad_w = fp8_gemm(dyt_q, xt_q, out_dtype=weight.dtype, batch_invariant=False)  # (N, K)
            if ctx.cache.shard is not None:  # a sharded master: its rows of the sum over ranks (weight_shard.py)
                grad_w = ctx.cache.shard.reduce(grad_w)
        return grad_x, grad_w, None, None, None, None


class _StackedFloat8LinearFn(torch.autograd.Function):
    """Sibling projections (q/k/v, gate/up) in training as one Function over their stacked weight (the math is in
    projection_group.py): returns each member's (M, n_i) output, a column block of one fprop GEMM; backward
    quantizes the members' gradients into one stacked dY, runs one dgrad against W_s^T and one wgrad whose row
    blocks are the members' dW."""

    @staticmethod
    def forward(ctx, x2d, group, spec: LinearPrecision, x_both: tuple[Float8Blocks, Float8Blocks], *weights):
        x_q, xt_q = x_both
        ctx.group, ctx.spec, ctx.x_dtype = group, spec, x2d.dtype
        ctx.set_materialize_grads(False)  # an unused member's gradient stays None: its weight gets none
        ctx.save_for_backward(xt_q.codes, xt_q.scales, *weights)  # X^T (K, M) in FP8, shared by the members' wgrads
        y = fp8_gemm(x_q, group.stacked_weight(spec.weight), out_dtype=x2d.dtype)  # (M, N_total)
        return tuple(y[:, o:o + n] for o, n in group.columns())

    @staticmethod
    def backward(ctx, *grads):
        spec, group = ctx.spec, ctx.group
        xt_codes, xt_scales, *weights = ctx.saved_tensors
        used = [g is not None for g in grads]
        if not any(used):
            return None, None, None, None, *([None] * len(weights))
        rows = next(g for g in grads if g is not None).shape[0]
        grads = [g if g is not None else xt_codes.new_zeros((rows, n), dtype=ctx.x_dtype)
                 for g, (_, n) in zip(grads, group.columns())]
        dy_q, dyt_q = quantize_columns_with_transpose(grads, pow2_scale=spec.grad_output.pow2_scale,
                                                      name=f"{group.name}.grad_output", col_major_scales=grads[0].is_cuda)
        grad_x, grad_ws = None, [None] * len(weights)
        if ctx.needs_input_grad[0]:  # (M, K): one GEMM over every member's columns, rounded once
            grad_x = fp8_gemm(dy_q, group.stacked_weight_t(spec.weight), out_dtype=ctx.x_dtype, batch_invariant=False)
        if any(ctx.needs_input_grad[4:]):  # (N_total, K): member i's dW is its row block
            dw = fp8_gemm(dyt_q, Float8Blocks(xt_codes, xt_scales, spec.wgrad.block), out_dtype=weights[0].dtype,
                          batch_invariant=False)
            grad_ws = [(dw[o:o + n] if m.weight_cache.shard is None else m.weight_cache.shard.reduce(dw[o:o + n]))
                       if u else None for (o, n), u, m in zip(group.columns(), used, group.members)]
        return grad_x, None, None, None, *grad_ws


def _quantize_both(t: torch.Tensor, rows: QuantSpec, tokens: QuantSpec, name: str) -> tuple[Float8Blocks, Float8Blocks]:
    """q(t) in ``rows``' groups and q(t^T) in ``tokens``' groups; fused when both are 1x128 alike."""
    if rows == tokens and rows.block == (1, BLOCK):
        return quantize_with_transpose(t, pow2_scale=rows.pow2_scale, name=name, col_major_scales=t.is_cuda)
    return _quantize(t, rows, name), _quantize(t.t(), tokens, f"{name}_t")


def _quantize(t: torch.Tensor, spec: QuantSpec, name: str) -> Float8Blocks:
    """q(t) in ``spec``; on CUDA with column-major scales, the layout cuBLAS's block-scaled GEMM reads (the GEMMs of
    this file would otherwise copy every activation's and gradient's scales into it)."""
    return quantize(t, spec.block, pow2_scale=spec.pow2_scale, name=name, col_major_scales=t.is_cuda)


_last_input = InputMemo()  # the last activation quantized, for sibling layers


def clear_shared_input() -> None:
    """Forget the held input quantization, so that the next Float8Linear call quantizes its input itself (a
    benchmark that feeds one tensor again and again times what every fresh activation costs in training)."""
    _last_input.clear()


def share_input_quantization(x: torch.Tensor, spec: QuantSpec, quantized: Float8Blocks) -> None:
    """Offer ``quantized`` = ``quantize(x)`` in ``spec`` (column-major scales on CUDA) to the next Float8Linear
    that reads ``x`` without autograd, as a sibling's quantization is (producer_quant.py)."""
    _last_input.put(x, spec, quantized)


class Float8Linear(nn.Linear):
    """``nn.Linear`` computed under a precision :class:`Recipe`; shares the original parameters.

    Build with :meth:`from_float` (or :func:`jetrl.fp8.convert_to_float8`).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, recipe: Recipe,
                 name: str = "linear", device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.recipe = recipe
        self.fqn = name
        self.weight_cache = WeightCache(f"{name}.weight")
        self.projection_group = None  # set by jetrl.fp8.projection_group.install_projection_groups

    @classmethod
    def from_float(cls, linear: nn.Linear, recipe: Recipe, name: str = "linear") -> Float8Linear:
        """Wrap ``linear`` without copying: the new module holds the same Parameter objects."""
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, linear.bias is not None, recipe=recipe, name=name)
        new.weight = linear.weight
        new.bias = linear.bias
        return new

    def precision(self) -> LinearPrecision:
        return self.recipe.linear(current_phase())

    def quantized_weight(self) -> Float8Blocks | None:
        """The cached FP8 weight the rollout reads (and the export writes); None if the rollout is BF16."""
        spec = self.recipe.rollout.weight or self.recipe.train.weight
        if spec is None:
            return None
        if self.projection_group is not None and self.weight.is_cuda:
            self.projection_group.stacked_weight(spec)  # the entry is a view of the group's stacked buffer
        return self.weight_cache.get(self.weight, spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spec = self.precision()
        if not spec.is_fp8:
            return F.linear(x, self.weight, self.bias)
        self._check_input(x)
        x2d = x.reshape(-1, self.in_features)
        if not torch.is_grad_enabled():  # inference: no Function; siblings share the input's quantization
            def x_q() -> Float8Blocks:
                return _last_input.get(x, spec.input, lambda: _quantize(x2d, spec.input, f"{self.fqn}.input"))

            group = self.projection_group
            if group is not None and group.applies(x, spec):
                y = group.output(self, x, spec, x_q)  # a column slice of the siblings' stacked GEMM
            else:
                y = fp8_gemm(x_q(), self.weight_cache.get(self.weight, spec.weight), out_dtype=x2d.dtype)
            y = y.view(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias.to(y.dtype)
        x_both = None
        if self.weight.requires_grad and spec.grad_output is not None:  # wgrad will need X^T
            # siblings (q/k/v, gate/up) share X's two layouts: one pass, and one saved X^T for their wgrads
            x_both = _last_input.get(x, ("fprop+wgrad", spec.input, spec.wgrad),
                                     lambda: _quantize_both(x2d, spec.input, spec.wgrad, f"{self.fqn}.input"))
        group = self.projection_group
        if x_both is not None and group is not None and group.trains(x, spec):  # siblings: one Function (CUDA)
            y = group.train_output(self, x, spec, lambda: _StackedFloat8LinearFn.apply(
                x2d, group, spec, x_both, *(m.weight for m in group.members)))
        else:
            y = _Float8LinearFn.apply(x2d, self.weight, self.weight_cache, spec, self.fqn, x_both)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def _check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor) or x.dtype not in _FLOAT_DTYPES:
            got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
            raise TypeError(f"{self.fqn}: Float8Linear input must be float32/bfloat16/float16, got {got}")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"{self.fqn}: input's last dim is {x.shape[-1] if x.dim() else None}, expected "
                f"in_features={self.in_features} (input shape {tuple(x.shape)})"
            )
        if x.numel() == 0:
            raise ValueError(f"{self.fqn}: empty input of shape {tuple(x.shape)}")

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name}"
