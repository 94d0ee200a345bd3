"""Triton kernel of the one quantizer; its spec is :func:`jetrl.fp8.quant.quantize_reference`.

Three kernels:

* ``_quantize_kernel``: one program quantizes a (TILE_R, GC) tile of x (R, C), GC the group
  width (128 for GEMM operands; the head_dim, a power of two from 16 to 128, for the per-token
  KV-cache groups). With 1xGC groups each tile row is a group, with 128x128 blocks the whole
  tile (TILE_R = 128) is one block. It reads x through its strides, so the wgrad operand
  ``x.t()`` is quantized without a transpose copy, and it writes row-major codes (R, C) and
  fp32 scales (ceil(R/GR), ceil(C/GC)).
* ``_quantize_dual_kernel``: one pass over x (M, K) that writes *both* layouts a linear layer
  needs -- q(x) in 1x128 groups along K (fprop, dgrad) and q(x^T) in 1x128 groups along M
  (wgrad) -- per (128, 128) tile: the tile's rows are quantized, then the tile is read again
  transposed and *its* rows are, both by the one row function. DRAM sees x once (the second read
  hits the cache), and x^T is never materialized. Each layout's codes and scales are exactly those
  of ``quantize_reference(x, 1, 128)`` and ``quantize_reference(x.t(), 1, 128)``.

* ``_quantize_dequantize_kernel``: deq(q(x)) per 1xD row in one pass (the trainer's FP8 K/V,
  kv_quant.py): the row quantizer above, then each code decoded exactly and multiplied by its
  scale in fp32, rounded once to x's dtype -- what the engine's FP8 cache returns.

The arithmetic is the reference's, operation for operation, so the GPU codes are
bit-identical to it:

    amax = max|x| over the group               (NaN/Inf map to +inf first: tl.max drops NaN)
    s    = max(div_rn(amax, 448), 2^-126)      IEEE division, not Triton's approximate '/'
    s    = 2^ceil(log2 s) by exponent bits     (pow2 scales)
    r    = div_rn(1, s)
    q    = e4m3_rne(clamp(x * r, -448, 448))   0x7F (NaN) for a group holding NaN/Inf

Under ``TRITON_INTERPRET=1`` on CPU the clamp, the final rounding to E4M3 (``_round_to_e4m3``) and the
NaN code are done explicitly, because the interpreter's own fp32 -> e4m3 cast mishandles carries into
the next binade; on the GPU the hardware's saturating RNE cast gives the same codes, and in the two quantize
kernels does the clamp and the NaN code itself (``_code_bits``: checked bit for bit by ``jetrl bench``;
``JETRL_QUANT_EXPLICIT_ROUND=1`` forces the software path).

Grids put the column tiles on the fastest program axis, so consecutive programs read
consecutive memory.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from jetrl.fp8.kernels.pdl import release, release_rows
from jetrl.fp8.quant import E4M3, E4M3_MAX, SCALE_FLOOR
from jetrl.overrides import env_choice

E4M3_MAX_C = tl.constexpr(E4M3_MAX)
SCALE_FLOOR_C = tl.constexpr(SCALE_FLOOR)
GROUP_WIDTHS = (16, 32, 64, 128)  # 1xGC group widths the kernel takes (tl.arange needs a power of two)
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
def _scale_and_reciprocal(amax, nonfinite, POW2: tl.constexpr):
    """s = max(div_rn(amax, 448), 2^-126) (pow2: rounded up by exponent bits), NaN if non-finite; r = div_rn(1, s)."""
    scale = tl.maximum(tl.math.div_rn(amax, E4M3_MAX_C), SCALE_FLOOR_C)
    if POW2:
        bits = scale.to(tl.int32, bitcast=True)
        exponent = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        scale = (exponent << 23).to(tl.float32, bitcast=True)
    scale = tl.where(nonfinite, float("nan"), scale)
    reciprocal = tl.math.div_rn(1.0, scale)
    return scale, reciprocal


@triton.jit
def _code_bits(y, is_nan, EXPLICIT_ROUND: tl.constexpr, BARE_CAST: tl.constexpr):
    """uint8 E4M3 codes of y = x * r: clamp, RNE, and the canonical NaN 0x7F where ``is_nan`` (a NaN scale).

    EXPLICIT_ROUND rounds in fp32/int32 ops first (the interpreter's own cast mishandles binade carries); on the
    GPU the hardware cast (``cvt.rn.satfinite``, RNE) gives the same codes on the clamped values, which the bench
    checks bit for bit. BARE_CAST (GPU only) leaves the clamp and the NaN select to that cast: it saturates to
    +-448 itself, and where ``is_nan`` the reciprocal is NaN, so y is NaN there (and only there), which it writes
    as 0x7F. That took 20% off the dual-layout pass (run BI, docs/benchmarks.md (a); but not every cut in its
    instruction count pays: the division-free scales, 13% fewer, were slower, run BO). Only the two quantize kernels below take it, whose codes go straight to memory: where codes are used
    again in registers, Triton 3.6 miscompiles the bare cast's packed result -- a kernel that decodes its own codes
    stores them right but decodes half of them wrong (bench/probe_bare_cast.py, run BM), and the K/V fake
    quantization and the producers' epilogues failed their GPU tests with it (run BJ).
    """
    if BARE_CAST and not EXPLICIT_ROUND:
        bits = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        y = tl.minimum(tl.maximum(y, -E4M3_MAX_C), E4M3_MAX_C)
        if EXPLICIT_ROUND:
            y = _round_to_e4m3(y)  # exact E4M3 values: the cast below does no rounding of its own
        # NaN codes are written as the canonical 0x7F, independent of how the backend casts NaN.
        bits = tl.where(is_nan, 0x7F, y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)).to(tl.uint8)
    return bits


@triton.jit
def _amax(x, axis: tl.constexpr):
    """max |x| along ``axis``, +inf for a group holding NaN or +-Inf (one reduction; tl.max drops NaN)."""
    return tl.max(tl.where(x == x, tl.abs(x), float("inf")), axis=axis)


@triton.jit
def quantize_rows(x, POW2: tl.constexpr, EXPLICIT_ROUND: tl.constexpr):
    """``_quantize_rows`` without the bare cast: the row function every fused kernel shares (module docstring)."""
    return _quantize_rows(x, POW2, EXPLICIT_ROUND, False)


@triton.jit
def _quantize_rows(x, POW2: tl.constexpr, EXPLICIT_ROUND: tl.constexpr, BARE_CAST: tl.constexpr):
    """(uint8 codes, scales) of a (rows, group) fp32 tile with one group per row: the 1xG quantizer's
    arithmetic, shared by every kernel that writes 1xG codes (the quantize and dual-layout kernels, the K/V-cache
    store in kv_store_triton.py, the producers' epilogues) -- one definition, so their codes and scales are the
    same bits. Layout-free (no tl.full), so Gluon kernels can call it too."""
    amax = _amax(x, 1)
    scale, reciprocal = _scale_and_reciprocal(amax, amax == float("inf"), POW2)
    return _code_bits(x * reciprocal[:, None], (scale != scale)[:, None], EXPLICIT_ROUND, BARE_CAST), scale


@triton.jit
def _quantize_kernel(
    x_ptr, codes_ptr, scales_ptr,
    R, C, stride_xr, stride_xc, stride_sr, stride_sc,
    GROUP_ROWS: tl.constexpr, GROUP_COLS: tl.constexpr, TILE_R: tl.constexpr, POW2: tl.constexpr,
    EXPLICIT_ROUND: tl.constexpr, RELEASE: tl.constexpr = False,
):
    release(RELEASE and GROUP_ROWS == 1)  # an activation's groups, never a weight's blocks (pdl.py)
    # a 1-D grid (a second grid axis holds at most 65535 row tiles: 2.1M rows of 128-wide KV groups), column groups
    # varying fastest: sequential reads
    col_groups = tl.cdiv(C, GROUP_COLS)
    pid = tl.program_id(0)
    pid_c, pid_r = pid % col_groups, pid // col_groups
    rows = pid_r.to(tl.int64) * TILE_R + tl.arange(0, TILE_R)  # int64: offsets of >= 2^31 elements
    cols = pid_c * GROUP_COLS + tl.arange(0, GROUP_COLS)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    x = tl.load(x_ptr + rows[:, None] * stride_xr + cols[None, :] * stride_xc, mask=mask, other=0.0).to(tl.float32)
    if GROUP_ROWS == 1:
        code_bits, scale = _quantize_rows(x, POW2, EXPLICIT_ROUND, True)  # (TILE_R, GROUP_COLS), (TILE_R,)
    else:
        amax = tl.max(_amax(x, 1), axis=0)  # scalar: one 128x128 block
        scale, reciprocal = _scale_and_reciprocal(amax, amax == float("inf"), POW2)
        code_bits = _code_bits(x * reciprocal, scale != scale, EXPLICIT_ROUND, True)
    tl.store(codes_ptr + rows[:, None] * C + cols[None, :], code_bits, mask=mask)
    if GROUP_ROWS == 1:
        tl.store(scales_ptr + rows * stride_sr + pid_c * stride_sc, scale, mask=rows < R)
    else:
        tl.store(scales_ptr + pid_r * stride_sr + pid_c * stride_sc, scale)


@triton.jit
def split_rows(rows, S1, S2):
    """(i0, i1, i2) of rows numbered row-major in a (S0, S1, S2, D) view: the kernels that walk a strided 4-D
    K/V by rows of D (below, and the K/V-cache prefill store in kv_store_triton.py)."""
    i2, i01 = rows % S2, rows // S2
    return i01 // S1, i01 % S1, i2


@triton.jit
def _quantize_dequantize_kernel(
    x_ptr, out_ptr, codes_ptr, scales_ptr, slots_ptr, N, S1, S2,
    sx0, sx1, sx2, sx3, so0, so1, so2, so3, sc0, sc1, sc2, ss0, ss1, ss2,
    D: tl.constexpr, TILE_R: tl.constexpr, POW2: tl.constexpr, EXPLICIT_ROUND: tl.constexpr,
    WRITE_CODES: tl.constexpr, SLOTS: tl.constexpr = False,
):
    # rows of D elements of a 4-D view (S0, S1, S2, D), numbered row-major, each read and written
    # through its own strides (the trainer's V is a transposed view: no copy in, the same layout out);
    # row (i0, i1, i2)'s codes and scale go to [i0, i1, i2] of their buffers, or to [slots[i0], i1, i2]
    # (SLOTS: a KV cache's prefill writes each prompt's rows into its slot)
    rows = tl.program_id(0).to(tl.int64) * TILE_R + tl.arange(0, TILE_R)
    ok = rows < N
    i0, i1, i2 = split_rows(rows, S1, S2)
    cols = tl.arange(0, D)
    x = tl.load(x_ptr + (i0 * sx0 + i1 * sx1 + i2 * sx2)[:, None] + cols[None, :] * sx3, mask=ok[:, None],
                other=0.0).to(tl.float32)
    code_bits, scale = quantize_rows(x, POW2, EXPLICIT_ROUND)
    y = code_bits.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, None]  # exact decode, one fp32 product
    if EXPLICIT_ROUND and out_ptr.dtype.element_ty == tl.bfloat16:
        # the interpreter's fp32 -> bf16 cast truncates: round to nearest even on the bits first (NaN kept
        # as is: the bit trick could carry a NaN's payload into the sign)
        bits = y.to(tl.int32, bitcast=True)
        y = tl.where(y != y, y, ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True))
    tl.store(out_ptr + (i0 * so0 + i1 * so1 + i2 * so2)[:, None] + cols[None, :] * so3,
             y.to(out_ptr.dtype.element_ty), mask=ok[:, None])
    if WRITE_CODES:
        if SLOTS:
            i0 = tl.load(slots_ptr + i0, mask=ok, other=0)
        tl.store(codes_ptr + (i0 * sc0 + i1 * sc1 + i2 * sc2)[:, None] + cols[None, :], code_bits, mask=ok[:, None])
        tl.store(scales_ptr + i0 * ss0 + i1 * ss1 + i2 * ss2, scale, mask=ok)


def quantize_dequantize_triton(
    x: torch.Tensor, pow2_scale: bool, *, with_codes: bool = False,
    into: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """deq(q(x)) per 1 x D row (D = x.shape[-1] in GROUP_WIDTHS, x of 1 to 4 dims) in one pass:
    ``(codes.float() * scales).to(x.dtype)`` of ``quantize_reference(x.reshape(-1, D), 1, D, pow2_scale)``,
    bit for bit, in x's own layout (``empty_like``). With ``with_codes`` also those codes (N, D) and
    scales (N, 1), for the recorders; else None, None.

    ``into = (codes, scales, slots)``: x is (S0, S1, S2, D) and the codes and scale of its row (i, j, t) are
    written at ``codes[slots[i], j, t]`` and ``scales[slots[i], j, t]`` (a KV cache layer's (slots, Hkv,
    max_len, D) uint8 codes and (slots, Hkv, max_len) fp32 scales, last dims contiguous); returns out, None,
    None. The same pass, so the cache holds exactly the codes whose decode ``out`` is."""
    assert 1 <= x.dim() <= 4 and x.shape[-1] in GROUP_WIDTHS and x.numel(), (x.shape, x.dtype)
    d = x.shape[-1]
    n = x.numel() // d
    out = torch.empty_like(x)
    x4, o4 = x[(None,) * (4 - x.dim())], out[(None,) * (4 - x.dim())]
    slots = None
    if into is not None:
        codes, scales, slots = into
        assert x.dim() == 4 and codes.dim() == 4 and scales.dim() == 3 and slots.shape == (x.shape[0],), (
            x.shape, codes.shape, scales.shape, slots.shape)
        assert codes.shape[1:] == (x.shape[1], codes.shape[2], d) and codes.shape[2] >= x.shape[2], (x.shape, codes.shape)
        assert codes.stride(3) == 1 and codes.element_size() == 1 and scales.dtype == torch.float32
        c4, s3 = codes.view(torch.uint8), scales
    elif with_codes:
        codes = torch.empty((n, d), dtype=E4M3, device=x.device)
        scales = torch.empty((n, 1), dtype=torch.float32, device=x.device)
        c4, s3 = codes.view(torch.uint8).view(x4.shape), scales.view(x4.shape[:3])
    else:
        codes = scales = None
        c4, s3 = o4, o4[..., 0]  # never written (WRITE_CODES off)
    tile_r = max(32, 4096 // d)
    _quantize_dequantize_kernel[(triton.cdiv(n, tile_r),)](
        x4, o4, c4, s3, out if slots is None else slots,
        n, x4.shape[1], x4.shape[2], *x4.stride(), *o4.stride(), *c4.stride()[:3], *s3.stride(),
        D=d, TILE_R=tile_r, POW2=pow2_scale, EXPLICIT_ROUND=explicit_round(), WRITE_CODES=codes is not None,
        SLOTS=slots is not None, num_warps=4,
    )
    return (out, None, None) if into is not None else (out, codes, scales)


def explicit_round() -> bool:
    """Round in software under the interpreter (or with JETRL_QUANT_EXPLICIT_ROUND=1), else by the hardware cast."""
    return os.environ.get("TRITON_INTERPRET") == "1" or env_choice(
        "JETRL_QUANT_EXPLICIT_ROUND", ("0", "1"), "1 = round to E4M3 in fp32/int32 ops, as under the interpreter; "
        "0 = the hardware cast, the default") == "1"


def scale_buffer(rows: int, groups: int, col_major: bool, device: torch.device) -> torch.Tensor:
    """An empty fp32 (rows, groups) scale tensor, row-major or column-major (strides (1, rows)); one allocation and
    no view, as an eager layer pays the host for every op (bench/probe_host_parts.py)."""
    return torch.empty_strided((rows, groups), (1, rows) if col_major else (groups, 1), dtype=torch.float32,
                               device=device)


def quantize_triton(
    x: torch.Tensor, br: int, bc: int, pow2_scale: bool, *, tile_rows: int | None = None, num_warps: int | None = None,
    col_major_scales: bool = False, out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same signature and result as ``quantize_reference``: (codes (R, C), scales (R/br, C/bc)).

    ``tile_rows`` / ``num_warps`` exist for the bench's tile sweep (1xGC groups only).
    ``col_major_scales`` writes the scales column-major (strides (1, R/br)), the layout cuBLAS's
    block-scaled GEMM takes for its A operand, so no transposing copy is needed before the GEMM.
    ``out``: (codes, scales) to write into -- codes contiguous (R, C), scales of any strides.
    """
    assert x.dim() == 2 and ((br, bc) == (128, 128) or (br == 1 and bc in GROUP_WIDTHS)), (x.shape, br, bc)
    rows, cols = x.shape
    num_row_groups, num_col_groups = triton.cdiv(rows, br), triton.cdiv(cols, bc)
    if out is not None:
        codes, scales = out
        assert codes.shape == (rows, cols) and codes.is_contiguous() and scales.shape == (num_row_groups, num_col_groups)
    else:
        codes = torch.empty((rows, cols), dtype=E4M3, device=x.device)
        scales = scale_buffer(num_row_groups, num_col_groups, col_major_scales, x.device)
    tile_r = 128 if br == 128 else (tile_rows or max(32, 4096 // bc))
    grid = (num_col_groups * triton.cdiv(rows, tile_r),)
    _quantize_kernel[grid](
        x, codes.view(torch.uint8), scales, rows, cols, x.stride(0), x.stride(1), scales.stride(0), scales.stride(1),
        GROUP_ROWS=br, GROUP_COLS=bc, TILE_R=tile_r, POW2=pow2_scale, EXPLICIT_ROUND=explicit_round(),
        num_warps=num_warps or (8 if br == 128 else 4), RELEASE=br == 1 and release_rows(x.device, rows),
    )
    return codes, scales


@triton.jit
def _quantize_dual_kernel(
    x_ptr, codes_ptr, scales_ptr, codes_t_ptr, scales_t_ptr,
    M, K, stride_xm, stride_xk, stride_cm, stride_sm, stride_sg, stride_tk, stride_tg, col0,
    POW2: tl.constexpr, EXPLICIT_ROUND: tl.constexpr, CHUNK: tl.constexpr, ROWS: tl.constexpr = 128,
):
    # One (128 m, 128 k) tile. Its rows are 1x128 groups of x: quantized at once. Then the tile is read again,
    # transposed, CHUNK k-columns at a time (from L2: DRAM sees x once): each such column is a 1x128 group of
    # x^T, quantized by the same row function. No amax crosses layouts (Triton still moves x^T's codes into the
    # store's layout through shared memory: Nsight Compute's bank conflicts in docs/benchmarks.md (a)).
    # x may be columns col0.. of a wider tensor's outputs (a multiple of 128; codes rows stride_cm apart): the
    # stacked gradient of sibling projections, one launch per sibling (quant.quantize_columns_with_transpose)
    pid_k, pid_m = tl.program_id(0), tl.program_id(1)
    m0, k0 = pid_m.to(tl.int64) * 128, pid_k.to(tl.int64) * 128
    g0 = col0 // 128
    # int64 only in the tile's base pointers; offsets inside a tile are int32 (the launcher bounds 128 rows of x and
    # of x^T's codes below 2^31 elements): 64-bit addresses per element cost registers, and registers bound how
    # many tiles an SM holds
    x_tile = x_ptr + m0 * stride_xm + k0 * stride_xk
    cols = tl.arange(0, 128)
    col_ok = cols < K - k0
    for r in range(128 // ROWS):  # the tile's rows, ROWS at a time (fewer live registers: more tiles per SM)
        rows_r = r * ROWS + tl.arange(0, ROWS)
        row_ok_r = rows_r < M - m0
        mask = row_ok_r[:, None] & col_ok[None, :]
        x = tl.load(x_tile + rows_r[:, None] * stride_xm + cols[None, :] * stride_xk, mask=mask, other=0.0)
        code_bits, scale = _quantize_rows(x.to(tl.float32), POW2, EXPLICIT_ROUND, True)
        tl.store(codes_ptr + m0 * stride_cm + col0 + k0 + rows_r[:, None] * stride_cm + cols[None, :], code_bits,
                 mask=mask)
        scales_tile = scales_ptr + m0 * stride_sm + (g0 + pid_k).to(tl.int64) * stride_sg
        tl.store(scales_tile + rows_r * stride_sm, scale, mask=row_ok_r)
    rows = tl.arange(0, 128)
    row_ok = rows < M - m0
    for c in range(128 // CHUNK):
        kc = c * CHUNK + tl.arange(0, CHUNK)
        kc_ok = kc < K - k0
        mask_t = kc_ok[:, None] & row_ok[None, :]
        xt = tl.load(x_tile + rows[None, :] * stride_xm + kc[:, None] * stride_xk, mask=mask_t, other=0.0)
        code_bits_t, scale_t = _quantize_rows(xt.to(tl.float32), POW2, EXPLICIT_ROUND, True)
        tl.store(codes_t_ptr + (col0 + k0) * M + m0 + kc[:, None] * M + rows[None, :], code_bits_t, mask=mask_t)
        tl.store(scales_t_ptr + (col0 + k0) * stride_tk + pid_m.to(tl.int64) * stride_tg + kc * stride_tk, scale_t,
                 mask=kc_ok)


def dual_fits(x: torch.Tensor, width: int | None = None) -> bool:
    """Whether ``_quantize_dual_kernel``'s int32 in-tile offsets hold for x (M, K) written into outputs ``width``
    columns wide (default K): 128 rows of x, of its codes and of x^T's codes stay below 2^31 elements (any M and K
    below ~16.7M). Else quantize in two passes (the same bits)."""
    return 128 * max(x.shape[0], x.shape[1], abs(x.stride(0)), abs(x.stride(1)), width or 0) < 2**31


def quantize_dual_triton(
    x: torch.Tensor, pow2_scale: bool, *, col_major_scales: bool = False, chunk: int = 32, rows: int = 64,
    num_warps: int = 4, out: tuple[torch.Tensor, ...] | None = None, out_col: int = 0, **launch
) -> tuple[torch.Tensor, ...]:
    """Same result as ``(*quantize_reference(x, 1, 128, p), *quantize_reference(x.t(), 1, 128, p))``.

    ``chunk`` / ``rows`` / ``num_warps`` (``launch``: further launch options, e.g. ``maxnreg``): the best of
    bench/sweep_quant_dual_v2.py on the H200 at the trainer's shapes, 1.02-1.04x the 128 / 128 / 8 warps before it
    (runs DM, DN; ~2.2-2.4 TB/s). Nsight Compute (run DL, bench/ncu_kernels.py) shows what bounds it: registers
    hold it to 4 warps per scheduler (25% occupancy), and the transposed half moves its codes between layouts
    through shared memory with bank conflicts; capping the registers spills and is slower (DM, DN).
    Against the two single-layout passes it replaces it is 1.06-1.09x on the GPU alone, and one launch instead of two
    also pays in eager training, where the host is the bottleneck at small shapes -- docs/benchmarks.md (a).

    Returns (codes (M, K), scales (M, K/128), codes_t (K, M), scales_t (K, M/128)): codes row-major, scales
    row-major or, with ``col_major_scales``, column-major -- the layout cuBLAS's block-scaled GEMM reads (no copy
    before it; as ``quantize(col_major_scales=True)``), and one the kernel stores 128 contiguous scales of.
    ``out``: those four for a wider tensor (M, W) -- contiguous codes (M, W) and (W, M), scales of any strides --
    into whose columns ``out_col`` .. ``out_col + K`` (``out_col`` a multiple of 128) x's are written; returns ``out``.
    """
    if x.dim() != 2:
        raise ValueError(f"quantize_dual_triton takes a 2-D tensor, got shape {tuple(x.shape)}")
    m, k = x.shape
    if out is None:
        codes = torch.empty((m, k), dtype=E4M3, device=x.device)
        codes_t = torch.empty((k, m), dtype=E4M3, device=x.device)
        scales = scale_buffer(m, triton.cdiv(k, 128), col_major_scales, x.device)
        scales_t = scale_buffer(k, triton.cdiv(m, 128), col_major_scales, x.device)
    else:
        codes, scales, codes_t, scales_t = out
    width = codes.shape[1]
    expected = ((m, width), (m, triton.cdiv(width, 128)), (width, m), (width, triton.cdiv(m, 128)))
    if (tuple(tuple(t.shape) for t in (codes, scales, codes_t, scales_t)) != expected or not codes.is_contiguous()
            or not codes_t.is_contiguous() or out_col % 128 or out_col + k > width or not dual_fits(x, width)):
        raise ValueError(f"quantize_dual_triton: x {tuple(x.shape)} at column {out_col} does not fit outputs of shapes "
                         f"{[tuple(t.shape) for t in (codes, scales, codes_t, scales_t)]} (want {list(expected)}, "
                         "codes contiguous, the column a multiple of 128, within int32 tile offsets)")
    _quantize_dual_kernel[(triton.cdiv(k, 128), triton.cdiv(m, 128))](
        x, codes.view(torch.uint8), scales, codes_t.view(torch.uint8), scales_t,
        m, k, x.stride(0), x.stride(1), width, *scales.stride(), *scales_t.stride(), out_col, POW2=pow2_scale,
        EXPLICIT_ROUND=explicit_round(), CHUNK=chunk, ROWS=rows, num_warps=num_warps, **launch,
    )
    return codes, scales, codes_t, scales_t
