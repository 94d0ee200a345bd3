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
def round_to(x, DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """fp32 -> DTYPE, round to nearest even (pass EMULATE=INTERPRET)."""
    if DTYPE == tl.bfloat16 and EMULATE:
        bits = x.to(tl.int32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & BF16_KEEP_C).to(tl.float32, bitcast=True)
        return tl.where(x != x, x, rounded).to(DTYPE)
    else:
        return x.to(DTYPE)  # LLVM fptrunc: RNE
