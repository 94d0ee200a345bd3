"""``kv_quant.dequantize_kv`` in registers: E4M3 K/V codes and their per-token-head scales to the model dtype.

Spec: :func:`jetrl.fp8.kv_quant.dequantize_kv`, ``rnd(f32(codes) * scale)`` -- the code converted exactly (every
E4M3 value is an fp16), one IEEE fp32 multiply, one round-to-nearest-even to the model dtype. Every kernel that
reads an FP8 KV cache dequantizes with :func:`dequantized`, so the values it attends over are the trainer's bit
for bit: the fused decode attention (engine/kernels/decode_attention_triton.py) and exact mode's attention
(models/kernels/exact_attention_triton.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from jetrl.fp8.kernels.rounding import round_to


@triton.jit
def e4m3_to_f16(codes, EMULATE: tl.constexpr):
    """uint8 E4M3 codes -> fp16 (exact), converted where they are loaded.

    On the GPU this is PTX ``cvt.rn.f16x2.e4m3x2`` marked impure, so that the compiler cannot move
    it behind the shared-memory layout change of a tl.dot operand: a V tile's reduction axis is not
    contiguous, and moving 8-bit codes into the mma layout costs one ld.shared.b8 per element,
    while fp16 values move with ldmatrix.trans (engine/kernels/decode_attention_triton.py). Under the
    interpreter (EMULATE) a plain cast: inline PTX cannot run there.
    """
    if EMULATE:
        return codes.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r", [codes], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def dequantized(codes, scale_row_ptr, pos, stride_scale, s_mask, DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """rnd(f32(codes) * scale) for a (positions, D) tile of uint8 codes; the scales of positions ``pos`` are read
    at ``scale_row_ptr + pos * stride_scale`` (0 where ``s_mask`` is off)."""
    scale = tl.load(scale_row_ptr + pos * stride_scale, mask=s_mask, other=0.0)
    return round_to(e4m3_to_f16(codes, EMULATE).to(tl.float32) * scale[:, None], DTYPE, EMULATE)
