"""Round-to-nearest-even from fp32 to a model dtype inside Triton kernels, also under the interpreter.

``TRITON_INTERPRET=1`` casts fp32 -> bf16 by truncation, so kernels tested on CPU against a
PyTorch reference (which rounds to nearest even) would differ in the last bit. ``round_to`` rounds
the fp32 bits to bf16's 7 mantissa bits there (a carry into the exponent is the correct round-up;
NaN passes through), and is the hardware cast on the GPU. fp16 and fp32 casts are exact or RNE in
both.
"""

from __future__ import annotations

import triton
import triton.language as tl

BF16_KEEP_C = tl.constexpr(-65536)  # 0xFFFF0000 as int32: sign, exponent and 7 mantissa bits
INTERPRET = bool(triton.knobs.runtime.interpret)  # as triton.jit itself decides, at import


@triton.jit
def rounded(x, DTYPE: tl.constexpr):
    """fp32 -> the nearest DTYPE value (RNE), returned as fp32: for a rounded intermediate.

    For bf16 the rounding is done on the bits with integer ops, on the GPU too: a float cast
    round trip ``x.to(bf16).to(fp32)`` can be contracted or folded by the compiler (on the H200 a
    fused RoPE written that way differed from eager PyTorch by one bf16 ulp), integer ops cannot.
    """
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        r = ((bits + 0x7FFF + ((bits >> 16) & 1)) & BF16_KEEP_C).to(tl.float32, bitcast=True)
        return tl.where(x != x, x, r)
    else:
        return x.to(DTYPE).to(tl.float32)


@triton.jit
def round_to(x, DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """fp32 -> DTYPE, round to nearest even (pass EMULATE=INTERPRET)."""
    if DTYPE == tl.bfloat16 and EMULATE:
        return rounded(x, DTYPE).to(DTYPE)  # exact: the value is already a bf16
    else:
        return x.to(DTYPE)  # LLVM fptrunc: RNE
