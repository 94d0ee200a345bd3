"""Triton kernel of the one quantizer; its spec is :func:`jetrl.fp8.quant.quantize_reference`.

One program quantizes a (TILE_R, 128) tile of x (R, C): with 1x128 groups each tile row is
a group, with 128x128 blocks the whole tile (TILE_R = 128) is one block. It reads x through
its strides, so the wgrad operand ``x.t()`` is quantized without a transpose copy, and it
writes row-major codes (R, C) and fp32 scales (ceil(R/GR), ceil(C/128)).

The arithmetic is the reference's, operation for operation, so the GPU codes are
bit-identical to it:

    amax = max|x| over the group               (NaN/Inf tracked separately: tl.max drops NaN)
    s    = max(div_rn(amax, 448), 2^-126)      IEEE division, not Triton's approximate '/'
    s    = 2^ceil(log2 s) by exponent bits     (pow2 scales)
    r    = div_rn(1, s)
    q    = e4m3_rne(clamp(x * r, -448, 448))   0x7F (NaN) for a group holding NaN/Inf

The final rounding to E4M3 is done explicitly (``_round_to_e4m3``), so the kernel gives the
reference's codes under ``TRITON_INTERPRET=1`` on CPU too, whose own fp32 -> e4m3 cast
mishandles carries into the next binade.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetrl.fp8.quant import E4M3, E4M3_MAX, SCALE_FLOOR

E4M3_MAX_C = tl.constexpr(E4M3_MAX)
SCALE_FLOOR_C = tl.constexpr(SCALE_FLOOR)
SIGN_BIT_C = tl.constexpr(-(2**31))  # 0x80000000 as int32
MANTISSA_KEEP_C = tl.constexpr(-(2**20))  # ~0xFFFFF: keep sign, exponent and 3 mantissa bits


@triton.jit
def _round_to_e4m3(y):
    """Round fp32 |y| <= 448 to the nearest E4M3 value, ties to even, in plain fp32/int32 ops.

    Normal range (|y| >= 2^-6): round the fp32 bit pattern to 3 mantissa bits (a carry into
    the exponent is the correct round-up to the next binade). Subnormal range: the E4M3 step
    is 2^-9, and (|y| + 2^14) - 2^14 rounds to it because the fp32 ulp at 2^14 is 2^-9.
    The sign (and -0) is carried over by bits. Done explicitly because the interpreter's cast
    mishandles the carry, and so the kernel does not depend on a backend's cast.
    """
    bits = y.to(tl.int32, bitcast=True)
    sign = bits & SIGN_BIT_C
    ay = tl.abs(y)
    abits = ay.to(tl.int32, bitcast=True)
    rounded = (abits + 0x7FFFF + ((abits >> 20) & 1)) & MANTISSA_KEEP_C
    normal = rounded.to(tl.float32, bitcast=True)
    subnormal = (ay + 16384.0) - 16384.0
    magnitude = tl.where(ay >= 0.015625, normal, subnormal)
    return (magnitude.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_kernel(
    x_ptr, codes_ptr, scales_ptr,
    R, C, stride_xr, stride_xc, num_col_groups,
    GROUP_ROWS: tl.constexpr, TILE_R: tl.constexpr, POW2: tl.constexpr,
):
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    rows = pid_r * TILE_R + tl.arange(0, TILE_R)
    cols = pid_c * 128 + tl.arange(0, 128)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    x = tl.load(x_ptr + rows[:, None] * stride_xr + cols[None, :] * stride_xc, mask=mask, other=0.0).to(tl.float32)
    ax = tl.abs(x)
    bad = (ax == float("inf")) | (x != x)
    if GROUP_ROWS == 1:
        amax = tl.max(ax, axis=1)  # (TILE_R,)
        nonfinite = tl.max(bad.to(tl.int32), axis=1) > 0
    else:
        amax = tl.max(tl.max(ax, axis=1), axis=0)  # scalar: one 128x128 block
        nonfinite = tl.max(tl.max(bad.to(tl.int32), axis=1), axis=0) > 0
    scale = tl.maximum(tl.math.div_rn(amax, E4M3_MAX_C), SCALE_FLOOR_C)
    if POW2:
        bits = scale.to(tl.int32, bitcast=True)
        exponent = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        scale = (exponent << 23).to(tl.float32, bitcast=True)
    scale = tl.where(nonfinite, float("nan"), scale)
    reciprocal = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    if GROUP_ROWS == 1:
        y = x * reciprocal[:, None]
        row_nan = nonfinite[:, None]
    else:
        y = x * reciprocal
        row_nan = nonfinite
    y = _round_to_e4m3(tl.minimum(tl.maximum(y, -E4M3_MAX_C), E4M3_MAX_C))
    # y now holds exact E4M3 values, so the cast below does no rounding of its own. NaN codes
    # are written as the canonical 0x7F, independent of how the backend casts NaN.
    code_bits = tl.where(row_nan, 0x7F, y.to(tl.float8e4nv).to(tl.uint8, bitcast=True))
    tl.store(codes_ptr + rows[:, None] * C + cols[None, :], code_bits.to(tl.uint8), mask=mask)
    if GROUP_ROWS == 1:
        tl.store(scales_ptr + rows * num_col_groups + pid_c, scale, mask=rows < R)
    else:
        tl.store(scales_ptr + pid_r * num_col_groups + pid_c, scale)


def quantize_triton(
    x: torch.Tensor, br: int, bc: int, pow2_scale: bool, *, tile_rows: int | None = None, num_warps: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same signature and result as ``quantize_reference``: (codes (R, C), scales (R/br, C/bc)).

    ``tile_rows`` / ``num_warps`` exist for the bench's tile sweep (1x128 groups only).
    """
    assert x.dim() == 2 and bc == 128 and br in (1, 128), (x.shape, br, bc)
    rows, cols = x.shape
    num_row_groups, num_col_groups = triton.cdiv(rows, br), triton.cdiv(cols, bc)
    codes = torch.empty((rows, cols), dtype=E4M3, device=x.device)
    scales = torch.empty((num_row_groups, num_col_groups), dtype=torch.float32, device=x.device)
    tile_r = 128 if br == 128 else (tile_rows or 32)
    grid = (triton.cdiv(rows, tile_r), num_col_groups)
    _quantize_kernel[grid](
        x, codes.view(torch.uint8), scales, rows, cols, x.stride(0), x.stride(1), num_col_groups,
        GROUP_ROWS=br, TILE_R=tile_r, POW2=pow2_scale, num_warps=num_warps or (8 if br == 128 else 4),
    )
    return codes, scales
