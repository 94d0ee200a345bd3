"""Triton backward kernels of RMSNorm and SwiGLU, one launch each (RoPE's is its forward kernel with
``BACKWARD=True``, in :mod:`jetrl.models.kernels.fused_triton`).

Why: an H200 profile of one training update (8-layer 8B-shaped Qwen3, 2 micro-batches of 8 x 1152
tokens, fwd + bwd + AdamW) spent ~280 of 585 ms outside the GEMMs -- aten::mul 69 ms in 865 kernels,
aten::copy_ 36-47 ms, add_/sum/pow/mean/cat/silu_backward ~40 ms more -- much of it autograd through
the fp32 references: ~10 full-tensor fp32 passes per op, for 4 RMSNorms per layer (input and
post-attention norms on (tokens, 4096), q_norm on (tokens, 32, 128), k_norm on (tokens, 8, 128)),
RoPE on q and k, and SwiGLU on (tokens, 12288). These kernels read each input once and write each
gradient once. Specs: autograd through :func:`jetrl.models.fused.rms_norm_reference` and
:func:`jetrl.models.fused.silu_mul_reference`.

Math and rounding (round = RNE to a dtype; each line says where it follows the reference's autograd):

    RMSNorm   r = rsqrt(sum(x^2) / D + eps) per row, fp32 (recomputed from x; the row sum's order is
              the kernel's, as in the forward);  n = x * r (fp32);  y = w * round_x(n).
              The cast round_x(n) passes gradients through unchanged, as in autograd:
              g     = round_x(grad_y * w)                    the reference's mul backward, rounded to x's dtype
              gx    = round_x(r * (g - n * sum(g * n) / D))  one fp32 expression, rounded once
              gw    = round_w(sum_rows round_y(grad_y * round_x(n)))   products rounded as the
                      reference's mul backward does (y's dtype), summed in fp32
              with a residual gradient gr (add_rms_norm, whose input also feeds the residual stream):
              gx'   = round_x(gx + gr)                       autograd's accumulation of x's two
                      gradients, bit for bit: the same two x-dtype values added once, in the
                      kernel instead of a separate pass over three (tokens, hidden) tensors
    SwiGLU    s = round(g / (1 + e)), sig = 1 / (1 + e), e = exp(-g)      (fp32, as the forward)
              grad_u = round(grad * s);  grad_g = round(round(grad * u) * sig * (1 + g * (1 - sig)))
              (the reference's mul backward, then PyTorch's silu_backward in fp32, in its order)

What differs from the reference: RMSNorm's gx is computed as one fp32 expression where autograd
chains ~8 fp32 ops (rsqrt, mean, pow and mul backwards), so it agrees to a few fp32 ulps of the
row's scale before the final rounding; gw's sum runs in another order (each program sums its run
of consecutive rows into an fp32 row of a (programs, D) workspace, then one torch sum over
programs: no atomics, so run-to-run deterministic, but the order depends on the number of
programs, i.e. the GPU's SM count). r is recomputed, so round_x(n) in gw may differ by one ulp
from the forward's in a row (as it may between the forward kernel and the reference's autograd). SwiGLU differs only
where the compiler contracts its fp32 multiply-adds differently from PyTorch's CUDA kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetrl.fp8.kernels import sm_count
from jetrl.fp8.kernels.rounding import INTERPRET, round_to, rounded
from jetrl.models.kernels.fused_triton import _TL_DTYPES, row_grid, silu_rounded

_EMULATE = INTERPRET
RMS_NORM_BACKWARD_MAX_COLS = 8192  # one row per block in registers; wider rows take autograd through the reference
_PROGRAMS_PER_SM = 16  # RMSNorm backward: programs, each owning one fp32 partial row of grad_w (H200 sweep: 8-32)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 2  # the interpreter: few programs, so each loops over several row blocks
    return sm_count(device)


@triton.jit
def _rms_norm_bwd_kernel(x_ptr, w_ptr, gy_ptr, gr_ptr, gx_ptr, gw_ptr, num_rows, num_cols, inner,
                         sx_outer, sx_inner, sg_outer, sg_inner, sr_outer, sr_inner, eps,
                         BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ITERS: tl.constexpr, X_DTYPE: tl.constexpr,
                         Y_DTYPE: tl.constexpr, HAS_GW: tl.constexpr, HAS_RES: tl.constexpr, EMULATE: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_C)
    col_ok = cols < num_cols
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    gw = tl.zeros((BLOCK_R, BLOCK_C), tl.float32)  # this program's partial grad_w, reduced over BLOCK_R at the end
    for i in range(ITERS):  # this program's ITERS consecutive row blocks
        rows = (pid.to(tl.int64) * ITERS + i) * BLOCK_R + tl.arange(0, BLOCK_R)
        mask = (rows[:, None] < num_rows) & col_ok[None, :]  # masked lanes (past the last row) load 0, add 0 to gw
        # row r of the (outer, inner) row grid, as in the forward; grad_y has its own strides
        x_rows = (rows // inner) * sx_outer + (rows % inner) * sx_inner
        g_rows = (rows // inner) * sg_outer + (rows % inner) * sg_inner
        x = tl.load(x_ptr + x_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        gy = tl.load(gy_ptr + g_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        r = tl.math.rsqrt(tl.math.div_rn(tl.sum(x * x, axis=1), num_cols.to(tl.float32)) + eps)
        n = x * r[:, None]
        g = rounded(gy * w[None, :], X_DTYPE)
        mean_gn = tl.math.div_rn(tl.sum(g * n, axis=1), num_cols.to(tl.float32))
        gx = r[:, None] * (g - n * mean_gn[:, None])
        if HAS_RES:  # x's second gradient, from the residual stream: autograd's add, one rounding (module docstring)
            r_rows = (rows // inner) * sr_outer + (rows % inner) * sr_inner
            gr = tl.load(gr_ptr + r_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            gx = rounded(gx, X_DTYPE) + gr
        tl.store(gx_ptr + rows[:, None] * num_cols + cols[None, :], round_to(gx, X_DTYPE, EMULATE), mask=mask)
        if HAS_GW:
            gw += rounded(gy * rounded(n, X_DTYPE), Y_DTYPE)
    if HAS_GW:
        tl.store(gw_ptr + pid * num_cols + cols, tl.sum(gw, axis=0), mask=col_ok)


def rms_norm_backward_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, grad: torch.Tensor,
                             need_weight_grad: bool = True, residual_grad: torch.Tensor | None = None,
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(grad_x, grad_weight) of ``rms_norm_reference(x, weight, eps)`` for the output's gradient ``grad``.

    ``x`` and ``grad`` may be strided in their leading dims as in ``rms_norm_triton``; grad_x is
    contiguous. grad_weight is None unless ``need_weight_grad``. ``residual_grad`` (x's shape and dtype):
    a second gradient of x, added in the kernel -- ``grad_x + residual_grad`` bit for bit, one pass fewer.
    """
    cols = x.shape[-1]
    y_dtype = torch.promote_types(weight.dtype, x.dtype)
    assert weight.shape == (cols,) and weight.is_contiguous() and x.dtype in _TL_DTYPES, (x.shape, weight.shape)
    assert grad.shape == x.shape and grad.dtype == y_dtype, (grad.shape, grad.dtype, x.shape, y_dtype)
    assert cols <= RMS_NORM_BACKWARD_MAX_COLS, cols
    if residual_grad is not None:
        assert residual_grad.shape == x.shape and residual_grad.dtype == x.dtype, (residual_grad.shape, x.shape)
    x3, g3 = row_grid(x), row_grid(grad)  # (outer, inner, C) each
    r3 = g3 if residual_grad is None else row_grid(residual_grad)
    inner, num_rows = x3.shape[1], x3.shape[0] * x3.shape[1]
    grad_x = torch.empty((num_rows, cols), dtype=x.dtype, device=x.device)
    block_c = triton.next_power_of_2(cols)
    block_r = max(1, min(64, 2048 // block_c))  # H200, 9216 tokens: 2048 elements a block, 8 warps were best
    num_blocks = triton.cdiv(num_rows, block_r)
    # each program takes ITERS row blocks, a power of two (a constexpr: few compiled variants, and a
    # loop bound the interpreter takes), so that about _PROGRAMS_PER_SM programs run per SM
    iters = max(1, triton.next_power_of_2(triton.cdiv(num_blocks, _PROGRAMS_PER_SM * _num_sms(x.device))))
    num_programs = max(1, triton.cdiv(num_blocks, iters))  # at least one, to write grad_w's zeros for no rows
    # (P, C) fp32 partial sums of grad_w, one row per program; summed below in a fixed order
    partial = torch.empty((num_programs, cols), dtype=torch.float32, device=x.device) if need_weight_grad else grad_x
    _rms_norm_bwd_kernel[(num_programs,)](
        x3, weight, g3, r3, grad_x, partial, num_rows, cols, inner,
        x3.stride(0), x3.stride(1), g3.stride(0), g3.stride(1), r3.stride(0), r3.stride(1), eps,
        BLOCK_R=block_r, BLOCK_C=block_c, ITERS=iters, X_DTYPE=_TL_DTYPES[x.dtype], Y_DTYPE=_TL_DTYPES[y_dtype],
        HAS_GW=need_weight_grad, HAS_RES=residual_grad is not None, EMULATE=_EMULATE,
        num_warps=8 if block_c <= 4096 else 16,
    )
    grad_w = partial.sum(0).to(weight.dtype) if need_weight_grad else None
    return grad_x.view(x.shape), grad_w


@triton.jit
def _silu_mul_bwd_kernel(g_ptr, u_ptr, gy_ptr, gg_ptr, gu_ptr, num_cols, stride_g, stride_u, stride_gy,
                         BLOCK: tl.constexpr, DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < num_cols
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    gy = tl.load(gy_ptr + row * stride_gy + cols, mask=mask, other=0.0).to(tl.float32)
    e, silu = silu_rounded(g, DTYPE, EMULATE)  # the forward's silu(g), as the reference rounds it
    sig = tl.math.div_rn(1.0, 1.0 + e)
    g_silu = rounded(gy * u, DTYPE)  # mul's backward: the gradient reaching silu(g)
    gg = g_silu * sig * (1.0 + g * (1.0 - sig))  # PyTorch's silu_backward, fp32
    tl.store(gg_ptr + row * num_cols + cols, round_to(gg, DTYPE, EMULATE), mask=mask)
    tl.store(gu_ptr + row * num_cols + cols, round_to(gy * silu, DTYPE, EMULATE), mask=mask)


def silu_mul_backward_triton(gate: torch.Tensor, up: torch.Tensor,
                             grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_gate, grad_up) of ``silu_mul_reference(gate, up)`` for the output's gradient ``grad``.

    Rows may be strided, as in ``silu_mul_triton``; both gradients are contiguous.
    """
    assert gate.shape == up.shape == grad.shape, (gate.shape, up.shape, grad.shape)
    assert gate.dtype == up.dtype == grad.dtype and gate.dtype in _TL_DTYPES, (gate.dtype, up.dtype, grad.dtype)
    cols = gate.shape[-1]
    g2, u2, gy2 = (t.reshape(-1, cols) for t in (gate, up, grad))
    g2, u2, gy2 = (t if t.stride(-1) == 1 else t.contiguous() for t in (g2, u2, gy2))
    grad_gate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    grad_up = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    rows, block = g2.shape[0], 1024
    _silu_mul_bwd_kernel[(rows, triton.cdiv(cols, block))](
        g2, u2, gy2, grad_gate, grad_up, cols, g2.stride(0), u2.stride(0), gy2.stride(0),
        BLOCK=block, DTYPE=_TL_DTYPES[gate.dtype], EMULATE=_EMULATE, num_warps=4,
    )
    return grad_gate, grad_up
