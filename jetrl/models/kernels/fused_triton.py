"""Triton kernels for the model's small ops, one launch each: RMSNorm (alone or after the residual add),
per-head q/k RMSNorm + RoPE for q and k together, RoPE, SwiGLU forward, RoPE backward.

Why: at decode sizes every elementwise op of the model is a separate, launch-bound kernel. The
H200 profile of one 8B decode step (docs/benchmarks.md, section d) shows ~180 µs per layer of
copies, elementwise ops and reductions next to 165 µs of attention and 172 µs of GEMMs; eager
RMSNorm alone is 8 kernels (upcast, square, mean, +eps, rsqrt, scale, downcast, weight) and
RoPE 5 per tensor (neg, cat, two products, sum). Specs: :func:`jetrl.models.fused.rms_norm_reference`
and :func:`jetrl.models.fused.apply_rope_reference`. In training these ops are not cheap next to
the GEMMs either (an H200 update spent ~280 of 585 ms outside them, much in these ops' autograd):
the backward kernels are in :mod:`jetrl.models.kernels.fused_backward_triton`, except RoPE's,
which is the kernel below with ``BACKWARD=True`` (RoPE is linear: its backward is a rotation too).

Numerics, op for op as the references compute them in PyTorch (each product or sum of two
model-dtype tensors is computed in fp32 and rounded once to the model dtype):

    RMSNorm   r = rsqrt(sum(x^2) / D + eps)   (fp32; the sum is a row reduction: its order is
                                               the kernel's, so r may differ from eager in the last
                                               bit -- but it is the same for a row whatever the batch)
              n = round_dtype(x * r);  y = round_out(w * n)
    RoPE      y = round(round(x * cos) + round(rotate_half(x) * sin)),  rotate_half([a, b]) = [-b, a]
              (bit-identical to the reference: no reduction)
              backward: gx = round(round(g * cos) + round(rotate_half^T(g * sin))),
              rotate_half^T([a, b]) = [b, -a]; bit-identical to autograd through the reference
    SwiGLU    s = round(g / (1 + exp(-g)));  y = round(s * u)     (fp32 division rounded to nearest,
                                              libdevice expf: the arithmetic of PyTorch's CUDA silu)
    add+norm  h = round(x + d) (as PyTorch adds), then RMSNorm of h; a compiled variant of the RMSNorm
              kernel, so its row sum may be ordered unlike the plain kernel's: the trainer and the
              engine both call this one for the post-attention norm
    q/k norm  RMSNorm of each head row (its sum in this kernel's order), rounded to the dtype, then
    + RoPE    RoPE as above on the rounded values; q and k in one launch

Producer-side quantization: the RMSNorm kernels and SwiGLU can also write their output's 1x128 FP8
quantization (``quantized``: :class:`~jetrl.models.fused.QuantizedOutput`), for the FP8 linear layer that reads
it (jetrl/fp8/producer_quant.py says when). The codes are ``quantize``'s: the epilogue runs the quantizer's row
function (``quantize_rows``) on the stored values. Whether a call quantizes is a *runtime* argument, the epilogue's
other arguments are not specialized and a call that does not quantize passes placeholders of the same dtypes, so
both kinds of call run one compiled binary: the output (the RMSNorm's row sum above all) is the same bits either
way. The same holds for ``early``, the runtime flag by which a decode-sized call releases the PDL-launched GEMM after
it (jetrl/fp8/kernels/pdl.py); ``GDC``, which compiles that instruction in at all, is a property of the device.
The trainer's forward (no epilogue) and the engine's decode (with it) therefore stay one graph. An earlier
version compiled the epilogue as a separate variant, whose row sum came out ordered differently
(docs/benchmarks.md, section d).

Rounded intermediates that are computed on further (``rounded``) are rounded on the fp32 bits with
integer ops everywhere, so no compiler can contract or fold them; final stores use ``round_to``,
the hardware RNE cast on the GPU (the interpreter's cast truncates, so there it rounds on the bits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from jetrl.fp8.kernels.pdl import gdc_supported, release_rows, release_when
from jetrl.fp8.kernels.quant_triton import explicit_round, quantize_rows
from jetrl.fp8.kernels.rounding import INTERPRET, round_to, rounded
from jetrl.models.fused import QuantizedOutput

_EMULATE = INTERPRET
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def row_grid(x: torch.Tensor) -> torch.Tensor:
    """``x`` (..., C) as an (outer, inner, C) grid of rows with unit column stride, a view where possible.

    A (B, T, H, D) view of a wider buffer (q/k as column slices of a stacked GEMM output) stays a
    view: the kernels address row r at ``(r // inner) * stride(0) + (r % inner) * stride(1)``.
    """
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.reshape(-1, 1, x.shape[-1]) if x.dim() < 3 else (x.flatten(0, -3) if x.dim() > 3 else x)


@triton.jit
def _store_quantized(y, rows, col0, num_rows, num_cols, codes_ptr, scales_ptr, stride_sr, stride_sc, pow2,
                     R: tl.constexpr, C: tl.constexpr, EXPLICIT_ROUND: tl.constexpr):
    """Store the 1x128 quantization of the (R, C) tile ``y`` (rows ``rows``, columns ``col0 + [0, C)``, as
    stored in the model dtype): the quantizer's own row arithmetic (``quantize_rows``), so the codes (row-major
    (num_rows, num_cols)) and scales (one per row and group, through their strides) are ``quantize``'s."""
    groups = tl.reshape(y.to(tl.float32), (R * (C // 128), 128))
    if pow2:  # a runtime value, like ``quant``: both branches are the one row quantizer
        code_bits, scale = quantize_rows(groups, True, EXPLICIT_ROUND)
    else:
        code_bits, scale = quantize_rows(groups, False, EXPLICIT_ROUND)
    cols = col0 + tl.arange(0, C)
    row_ok = rows[:, None] < num_rows
    tl.store(codes_ptr + rows[:, None] * num_cols + cols[None, :], tl.reshape(code_bits, (R, C)),
             mask=row_ok & (cols[None, :] < num_cols))
    group_cols = col0 // 128 + tl.arange(0, C // 128)
    tl.store(scales_ptr + rows[:, None] * stride_sr + group_cols[None, :] * stride_sc,
             tl.reshape(scale, (R, C // 128)), mask=row_ok & (group_cols[None, :] * 128 < num_cols))


# the quantizing epilogue's arguments and the PDL release flag are not specialized: a call that quantizes (or
# releases) and one that does not run the very same binary (module docstring, "Producer-side quantization")
_QUANT_ARGS = ["stride_sr", "stride_sc", "quant", "pow2", "early"]


@triton.jit(do_not_specialize=_QUANT_ARGS)
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, num_rows, num_cols, inner, stride_outer, stride_inner, stride_o, eps,
                     d_ptr, h_ptr, codes_ptr, scales_ptr, stride_sr, stride_sc, quant, pow2, early,
                     BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, X_DTYPE: tl.constexpr,
                     OUT_DTYPE: tl.constexpr, EMULATE: tl.constexpr, ADD: tl.constexpr,
                     EXPLICIT_ROUND: tl.constexpr, GDC: tl.constexpr):
    release_when(early, GDC)  # the next kernel (a decode GEMM on its output) may start loading its weight (pdl.py)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    col_ok = cols < num_cols
    mask = (rows[:, None] < num_rows) & col_ok[None, :]
    # row r of the (outer, inner) row grid: x may be a strided view (a column slice of a stacked GEMM)
    x_rows = (rows // inner) * stride_outer + (rows % inner) * stride_inner
    x = tl.load(x_ptr + x_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if ADD:  # the residual add first: h = x + d (x, d and h contiguous), normalized below
        d = tl.load(d_ptr + rows[:, None] * num_cols + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = rounded(x + d, X_DTYPE)
        tl.store(h_ptr + rows[:, None] * num_cols + cols[None, :], round_to(x, X_DTYPE, EMULATE), mask=mask)
    mean_square = tl.math.div_rn(tl.sum(x * x, axis=1), num_cols.to(tl.float32))
    r = tl.math.rsqrt(mean_square + eps)
    n = rounded(x * r[:, None], X_DTYPE)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = round_to(w[None, :] * n, OUT_DTYPE, EMULATE)
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], y, mask=mask)
    if BLOCK_C % 128 == 0:  # noqa: SIM102 -- a compile-time guard: the epilogue needs 128-wide groups
        if quant:  # a runtime flag: the row sum above compiles the same either way
            _store_quantized(y, rows, 0, num_rows, num_cols, codes_ptr, scales_ptr, stride_sr, stride_sc, pow2,
                             BLOCK_R, BLOCK_C, EXPLICIT_ROUND)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    quantized: QuantizedOutput | None = None) -> torch.Tensor:
    """Same signature and result (up to the row sum's order) as ``rms_norm_reference``.

    ``x`` may be strided in its leading dims (rows are addressed as an (outer, inner) grid, so a
    (B, T, H, D) view of a wider buffer is read in place); the output is contiguous. ``quantized``: also
    write the output's 1x128 quantization into these buffers (:class:`QuantizedOutput`).
    """
    cols = x.shape[-1]
    assert weight.shape == (cols,) and weight.is_contiguous() and x.dtype in _TL_DTYPES, (x.shape, weight.shape)
    grid3 = row_grid(x)
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty((grid3.shape[0] * grid3.shape[1], cols), dtype=out_dtype, device=x.device)
    _launch_rms_norm(grid3, weight, out, eps, None, None, quantized)
    return out.view(*x.shape[:-1], cols)


def add_rms_norm_triton(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                        quantized: QuantizedOutput | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + delta`` (rounded once to x's dtype, as PyTorch adds) and ``rms_norm(h)``, in one pass: the
    residual add before a decoder layer's second norm. x and delta of one dtype and shape; both results
    contiguous. The norm is ``rms_norm_triton``'s arithmetic (its row sum may be ordered differently).
    ``quantized``: as in ``rms_norm_triton``, for the norm's output."""
    cols = x.shape[-1]
    assert x.shape == delta.shape and x.dtype == delta.dtype and x.dtype in _TL_DTYPES, (x.shape, delta.shape)
    assert weight.shape == (cols,) and weight.is_contiguous(), (weight.shape, cols)
    x2, d2 = x.reshape(-1, cols).contiguous(), delta.reshape(-1, cols).contiguous()
    h = torch.empty_like(x2)
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    _launch_rms_norm(x2.view(-1, 1, cols), weight, out, eps, d2, h, quantized)
    return h.view(x.shape), out.view(x.shape)


def _quant_args(quantized: QuantizedOutput | None, out: torch.Tensor) -> tuple:
    """(codes, scales, stride_sr, stride_sc, quant, pow2) for a launch; placeholders of the same dtypes when
    not quantizing, so that both kinds of call run one binary."""
    if quantized is None:
        codes, scales = _placeholders(out.device)
        return codes, scales, 0, 0, 0, 0
    codes, scales, pow2 = quantized
    assert codes.shape == out.shape and codes.is_contiguous() and out.shape[-1] % 128 == 0, (codes.shape, out.shape)
    assert scales.shape == (out.shape[0], out.shape[1] // 128) and scales.dtype == torch.float32, scales.shape
    return codes.view(torch.uint8), scales, scales.stride(0), scales.stride(1), 1, int(pow2)


_PLACEHOLDERS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _placeholders(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    if device not in _PLACEHOLDERS:
        _PLACEHOLDERS[device] = (torch.zeros(16, dtype=torch.uint8, device=device),
                                 torch.zeros(16, dtype=torch.float32, device=device))
    return _PLACEHOLDERS[device]


def _launch_rms_norm(grid3: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, eps: float,
                     delta: torch.Tensor | None, h: torch.Tensor | None, quantized: QuantizedOutput | None,
                     block_r: int | None = None, num_warps: int | None = None) -> None:
    """One launch of ``_rms_norm_kernel`` over the (outer, inner, C) rows of ``grid3``; with ``delta`` and
    ``h`` (contiguous) it adds ``delta`` first and writes the sum to ``h``. The tiles depend on C only,
    so a row's result does not depend on the batch. ``block_r`` / ``num_warps`` exist for
    bench/sweep_small_kernels.py (another warp count may order the row sum differently)."""
    num_rows, cols = out.shape
    block_c = triton.next_power_of_2(cols)
    block_r = block_r or max(1, min(64, 4096 // block_c))
    grid = (triton.cdiv(num_rows, block_r),)
    _rms_norm_kernel[grid](
        grid3, weight, out, num_rows, cols, grid3.shape[1], grid3.stride(0), grid3.stride(1), out.stride(0), eps,
        out if delta is None else delta, out if h is None else h, *_quant_args(quantized, out),
        int(release_rows(out.device, num_rows)),
        BLOCK_R=block_r, BLOCK_C=block_c, X_DTYPE=_TL_DTYPES[grid3.dtype], OUT_DTYPE=_TL_DTYPES[out.dtype],
        EMULATE=_EMULATE, ADD=delta is not None, EXPLICIT_ROUND=explicit_round(), GDC=gdc_supported(out.device),
        num_warps=num_warps or (4 if block_c * block_r <= 4096 else 8),
    )


@triton.jit
def _rotate(x1, x2, c1, c2, s1, s2, DTYPE: tl.constexpr):
    """RoPE on the two halves of rows, as eager computes x * cos + rotate_half(x) * sin,
    rotate_half([a, b]) = [-b, a]: each product and the sum rounded once to DTYPE (fp32 results)."""
    return (rounded(x1 * c1, DTYPE) + rounded(-x2 * s1, DTYPE),
            rounded(x2 * c2, DTYPE) + rounded(x1 * s2, DTYPE))


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, num_rows, H, T,
                 sxb, sxh, sxt, sxd, scb, sct, scd, ssb, sst, ssd, sob, soh, sot, sod,
                 HALF: tl.constexpr, BLOCK_R: tl.constexpr, DTYPE: tl.constexpr, BACKWARD: tl.constexpr,
                 EMULATE: tl.constexpr):
    # x is the input (forward) or the output's gradient (BACKWARD); out is y or grad_x
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # flattened (b, h, t)
    row_ok = rows < num_rows
    t = rows % T
    h = (rows // T) % H
    b = rows // (T * H)
    d = tl.arange(0, HALF)
    mask = row_ok[:, None]
    x_row = x_ptr + (b * sxb + h * sxh + t * sxt)[:, None]
    x1 = tl.load(x_row + d[None, :] * sxd, mask=mask, other=0.0).to(tl.float32)  # first half
    x2 = tl.load(x_row + (d[None, :] + HALF) * sxd, mask=mask, other=0.0).to(tl.float32)  # second half
    c_row = cos_ptr + (b * scb + t * sct)[:, None]
    s_row = sin_ptr + (b * ssb + t * sst)[:, None]
    c1 = tl.load(c_row + d[None, :] * scd, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(c_row + (d[None, :] + HALF) * scd, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(s_row + d[None, :] * ssd, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(s_row + (d[None, :] + HALF) * ssd, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        # grad_x = g * cos + rotate_half^T(g * sin), rotate_half^T([a, b]) = [b, -a]:
        #   [g1 c1 + g2 s2, g2 c2 - g1 s1], the forward's arithmetic with (s1, s2) -> (-s2, -s1).
        # Negation is exact and RNE is sign-symmetric, so the roundings stay the reference autograd's.
        s1, s2 = -s2, -s1
    y1, y2 = _rotate(x1, x2, c1, c2, s1, s2, DTYPE)
    o_row = out_ptr + (b * sob + h * soh + t * sot)[:, None]
    tl.store(o_row + d[None, :] * sod, round_to(y1, DTYPE, EMULATE), mask=mask)
    tl.store(o_row + (d[None, :] + HALF) * sod, round_to(y2, DTYPE, EMULATE), mask=mask)


def apply_rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Same signature and bit-identical result as ``apply_rope_reference``: x (B, H, T, D), cos/sin (B|1, T, D)."""
    return _rope(x, cos, sin, backward=False)


def apply_rope_backward_triton(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """grad_x of ``apply_rope_reference(x, cos, sin)`` for the output's gradient ``grad`` (B, H, T, D).

    Bit-identical to autograd through the reference: each product rounded to the dtype, then the sum.
    RoPE is linear in x, so x itself is not needed.
    """
    return _rope(grad, cos, sin, backward=True)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    B, H, T, D = x.shape
    assert D % 2 == 0 and (D // 2) & (D // 2 - 1) == 0, f"head_dim {D}: the kernel takes D/2 a power of two"
    assert cos.dtype == sin.dtype == x.dtype and x.dtype in _TL_DTYPES, (x.dtype, cos.dtype)
    cos, sin = cos.expand(B, T, D), sin.expand(B, T, D)  # a batch-1 table broadcasts with stride 0
    out = torch.empty_like(x)  # same strides as x (a transposed view stays one)
    num_rows = B * H * T
    block_r = max(1, min(32, 2048 // D))
    _rope_kernel[(triton.cdiv(num_rows, block_r),)](
        x, cos, sin, out, num_rows, H, T, *x.stride(), *cos.stride(), *sin.stride(), *out.stride(),
        HALF=D // 2, BLOCK_R=block_r, DTYPE=_TL_DTYPES[x.dtype], BACKWARD=backward, EMULATE=_EMULATE, num_warps=4,
    )
    return out


@triton.jit
def _norm_rope_rows(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, block, num_rows, H, T, sxb, sxt, sxh,
                    scb, sct, ssb, sst, eps, HALF: tl.constexpr, BLOCK_R: tl.constexpr, NORM: tl.constexpr,
                    DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """Rows ``block * BLOCK_R + [0, BLOCK_R)`` of x (B, T, H, 2 HALF), flattened with h fastest: the per-head
    RMSNorm (if NORM), then RoPE, into the contiguous (B, T, H, 2 HALF) ``out``. cos/sin rows have unit
    column stride."""
    rows = block.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask = (rows < num_rows)[:, None]
    h = rows % H
    t = (rows // H) % T
    b = rows // (H * T)
    d = tl.arange(0, HALF)
    x_row = x_ptr + (b * sxb + t * sxt + h * sxh)[:, None]
    x1 = tl.load(x_row + d[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF + d[None, :], mask=mask, other=0.0).to(tl.float32)
    if NORM:  # rms_norm_reference's arithmetic (the row sum in this kernel's order), rounded to DTYPE
        r = tl.math.rsqrt(tl.math.div_rn(tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1), 2.0 * HALF) + eps)
        w1 = tl.load(w_ptr + d).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + d).to(tl.float32)
        x1 = rounded(w1[None, :] * rounded(x1 * r[:, None], DTYPE), DTYPE)
        x2 = rounded(w2[None, :] * rounded(x2 * r[:, None], DTYPE), DTYPE)
    c_row = cos_ptr + (b * scb + t * sct)[:, None]
    s_row = sin_ptr + (b * ssb + t * sst)[:, None]
    c1 = tl.load(c_row + d[None, :], mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(c_row + HALF + d[None, :], mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(s_row + d[None, :], mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(s_row + HALF + d[None, :], mask=mask, other=0.0).to(tl.float32)
    y1, y2 = _rotate(x1, x2, c1, c2, s1, s2, DTYPE)
    o_row = out_ptr + (rows * (2 * HALF))[:, None]
    tl.store(o_row + d[None, :], round_to(y1, DTYPE, EMULATE), mask=mask)
    tl.store(o_row + HALF + d[None, :], round_to(y2, DTYPE, EMULATE), mask=mask)


@triton.jit
def _norm_rope_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, q_rows, k_rows, q_blocks,
                      Hq, Hk, T, sqb, sqt, sqh, skb, skt, skh, scb, sct, ssb, sst, eps,
                      HALF: tl.constexpr, BLOCK_R: tl.constexpr, NORM: tl.constexpr, DTYPE: tl.constexpr,
                      EMULATE: tl.constexpr):
    # one launch for q and k: the first q_blocks programs take q's rows, the rest k's
    pid = tl.program_id(0)
    if pid < q_blocks:
        _norm_rope_rows(q_ptr, qw_ptr, cos_ptr, sin_ptr, qo_ptr, pid, q_rows, Hq, T, sqb, sqt, sqh, scb, sct, ssb, sst,
                        eps, HALF, BLOCK_R, NORM, DTYPE, EMULATE)
    else:
        _norm_rope_rows(k_ptr, kw_ptr, cos_ptr, sin_ptr, ko_ptr, pid - q_blocks, k_rows, Hk, T, skb, skt, skh, scb, sct,
                        ssb, sst, eps, HALF, BLOCK_R, NORM, DTYPE, EMULATE)


def norm_rope_triton(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                     eps: float, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention's q/k preparation in one launch: per-head RMSNorm (with weights; none without them) then
    RoPE, for q (B, T, Hq, D) and k (B, T, Hk, D), which may be column slices of one stacked GEMM output.
    Returns them as (B, H, T, D) views of contiguous (B, T, H, D) buffers, as the unfused path does.

    Arithmetic: ``rms_norm_reference`` (row sum in this kernel's order: the norm may differ from
    ``rms_norm_triton``'s in the last bit, and is batch-invariant) then ``apply_rope_reference``, bit for
    bit given the normed values. q, k, weights, cos and sin share one dtype; D / 2 is a power of two.
    """
    B, T, Hq, D = q.shape
    assert k.shape[:2] == (B, T) and k.shape[3] == D and D % 2 == 0 and (D // 2) & (D // 2 - 1) == 0, (q.shape, k.shape)
    assert q.dtype == k.dtype == cos.dtype == sin.dtype and q.dtype in _TL_DTYPES, (q.dtype, k.dtype, cos.dtype)
    norm = q_weight is not None
    assert (k_weight is not None) == norm and (not norm or q_weight.dtype == k_weight.dtype == q.dtype)
    assert not norm or (q_weight.shape == k_weight.shape == (D,)
                        and q_weight.is_contiguous() and k_weight.is_contiguous()), "q/k norm weights: (D,), contiguous"
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    cos, sin = cos.expand(B, T, D), sin.expand(B, T, D)
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    qo = torch.empty((B, T, Hq, D), dtype=q.dtype, device=q.device)
    ko = torch.empty((B, T, k.shape[2], D), dtype=q.dtype, device=q.device)
    block_r = max(1, min(32, 2048 // D))
    q_rows, k_rows = B * T * Hq, B * T * k.shape[2]
    q_blocks = triton.cdiv(q_rows, block_r)
    _norm_rope_kernel[(q_blocks + triton.cdiv(k_rows, block_r),)](
        q, k, q_weight if norm else q, k_weight if norm else k, cos, sin, qo, ko, q_rows, k_rows, q_blocks,
        Hq, k.shape[2], T, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1), eps,
        HALF=D // 2, BLOCK_R=block_r, NORM=norm, DTYPE=_TL_DTYPES[q.dtype], EMULATE=_EMULATE, num_warps=4,
    )
    return qo.transpose(1, 2), ko.transpose(1, 2)


@triton.jit
def expf(x, EMULATE: tl.constexpr):
    """exp(x) in fp32 as PyTorch's CUDA silu computes it: libdevice's accurate expf (tl.exp is the fast
    ex2.approx form); under the interpreter numpy's expf."""
    if EMULATE:
        return tl.exp(x)
    return libdevice.exp(x)


@triton.jit
def silu_rounded(g, DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """(e, s) = (exp(-g), silu(g) rounded to DTYPE) in fp32, as PyTorch's CUDA silu computes them: the
    forward's and the backward kernel's one definition of silu."""
    e = expf(-g, EMULATE)
    return e, rounded(tl.math.div_rn(g, 1.0 + e), DTYPE)


@triton.jit(do_not_specialize=_QUANT_ARGS)
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, num_rows, num_cols, stride_g, stride_u,
                     codes_ptr, scales_ptr, stride_sr, stride_sc, quant, pow2, early,
                     BLOCK: tl.constexpr, DTYPE: tl.constexpr, EMULATE: tl.constexpr, EXPLICIT_ROUND: tl.constexpr,
                     GDC: tl.constexpr):
    release_when(early, GDC)  # the next kernel (down_proj's decode GEMM) may start loading its weight (pdl.py)
    row = tl.program_id(0).to(tl.int64)
    col0 = tl.program_id(1) * BLOCK
    cols = col0 + tl.arange(0, BLOCK)
    mask = cols < num_cols
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    _, s = silu_rounded(g, DTYPE, EMULATE)
    y = round_to(s * u, DTYPE, EMULATE)
    tl.store(out_ptr + row * num_cols + cols, y, mask=mask)
    if quant:
        _store_quantized(tl.reshape(y, (1, BLOCK)), row + tl.arange(0, 1), col0, num_rows, num_cols, codes_ptr,
                         scales_ptr, stride_sr, stride_sc, pow2, 1, BLOCK, EXPLICIT_ROUND)


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor, quantized: QuantizedOutput | None = None, *,
                    block: int = 1024, num_warps: int = 4) -> torch.Tensor:
    """Same signature and result as ``silu_mul_reference``: ``silu(gate) * up``, both (..., I) of one dtype.

    Rows may be strided (gate and up as column slices of one stacked GEMM output); the output is contiguous.
    ``quantized``: as in ``rms_norm_triton``. ``block`` / ``num_warps`` exist for bench/sweep_small_kernels.py
    (the result is elementwise: the same bits at any launch shape; ``block`` a multiple of 128).
    """
    assert gate.shape == up.shape and gate.dtype == up.dtype and gate.dtype in _TL_DTYPES, (gate.shape, up.shape)
    cols = gate.shape[-1]
    g2, u2 = gate.reshape(-1, cols), up.reshape(-1, cols)
    g2 = g2 if g2.stride(-1) == 1 else g2.contiguous()
    u2 = u2 if u2.stride(-1) == 1 else u2.contiguous()
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if block % 128 or block & (block - 1):
        raise ValueError(f"silu_mul_triton: block must be a power of two and a multiple of 128, got {block}")
    rows = g2.shape[0]
    _silu_mul_kernel[(rows, triton.cdiv(cols, block))](
        g2, u2, out, rows, cols, g2.stride(0), u2.stride(0), *_quant_args(quantized, out.view(rows, cols)),
        int(release_rows(out.device, rows)),
        BLOCK=block, DTYPE=_TL_DTYPES[gate.dtype], EMULATE=_EMULATE, EXPLICIT_ROUND=explicit_round(),
        GDC=gdc_supported(out.device), num_warps=num_warps,
    )
    return out
