"""An exact, division-free ``_scale_and_reciprocal`` for the GPU quantize kernels: its proof, on any machine.

Why: the dual-layout quantizer is bound by instruction issue (docs/benchmarks.md (a)), and compiled for sm_90 its two
IEEE divisions per group -- ``s = div_rn(amax, 448)`` and ``r = div_rn(1, s)`` -- are ~400 of its 2048 instructions
per thread (a variant with approximate divisions compiles to 1664): every thread repeats them for each row its slice
of the tile holds, and each ``div.rn`` is a range check, a branch to a slow path and a Newton sequence. The candidate
(``_scale_and_reciprocal_fast`` in bench/sweep_quant_dual_v2.py, ``CANDIDATES=fastdiv``) computes the same two fp32
values without a division:

    s = RN(amax / 448)    q0 = RN(amax * c), c = RN(1/448);  e = fma(-q0, 448, amax) (exact);  q = fma(e, c, q0)
                          (amax < 2^-100 is scaled by 2^64 first and q back by 2^-64, both exact, so no
                          intermediate is subnormal; results under 2^-126 are floored to 2^-126 as before)
    r = RN(1 / s)         y0 = rcp.approx(s) (the hardware's, within 2 ulps);  two fused Newton steps
                          y <- fma(y, fma(-s, y, 1), y);  except s with an all-ones significand, whose
                          RN(1/s) = 2^(-k-1) (1 + 2^-23) is written by its bits (the steps end one ulp low there)
    pow2 scales           r = 2^-k by exponent bits

This script checks both against IEEE division (numpy's fp32 ``/``) for every fp32 significand -- the results depend
only on the significand in the normal range -- at several binades (the tiny-amax path included), and the reciprocal
for every y0 within 2 ulps of 1/s, so whatever the hardware's approximation returns within its bound. FMAs are
emulated exactly (a float64 sum, and the cases near an fp32 midpoint redone in rationals). ~8 min on one core:

    python3 bench/prove_fast_scale.py

Run BN's session: every check passes. The candidate itself needs the GPU (inline PTX); the sweep checks its codes bit
for bit there before timing it.
"""

from fractions import Fraction

import numpy as np

C448 = np.float32(1) / np.float32(448)  # RN(1/448)
TINY, UP, DOWN = np.float32(2.0**-100), np.float32(2.0**64), np.float32(2.0**-64)
FLOOR = np.float32(2.0**-126)


def _round_f32(x: Fraction) -> np.float32:
    """Round-to-nearest-even of an exact rational to fp32 (normal range)."""
    if x == 0:
        return np.float32(0)
    sign, x = (-1 if x < 0 else 1), abs(x)
    e = x.numerator.bit_length() - x.denominator.bit_length()
    while Fraction(2) ** e > x:
        e -= 1
    while Fraction(2) ** (e + 1) <= x:
        e += 1
    ulp = Fraction(2) ** (e - 23)
    q, rest = divmod(x, ulp)
    q = int(q) + (1 if rest > ulp / 2 or (rest == ulp / 2 and int(q) % 2) else 0)
    return np.float32(sign * float(q * ulp))


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """RN_fp32(a * b + c), exactly: a * b is exact in float64; the sum's one float64 rounding can only change the fp32
    result next to an fp32 midpoint, and those cases are redone in rationals."""
    a64, b64, c64 = (np.broadcast_to(v, np.broadcast(a, b, c).shape).astype(np.float64) for v in (a, b, c))
    s64 = a64 * b64 + c64
    out = s64.astype(np.float32)
    low = (s64.view(np.uint64) & np.uint64((1 << 29) - 1)).astype(np.int64)
    for i in np.nonzero((np.abs(low - (1 << 28)) <= 4) & np.isfinite(s64) & (s64 != 0))[0]:
        out[i] = _round_f32(Fraction(float(a64[i])) * Fraction(float(b64[i])) + Fraction(float(c64[i])))
    return out


def fast_scale(amax: np.ndarray) -> np.ndarray:
    """The candidate's s (before the pow2 rounding), for finite amax >= 0."""
    tiny = amax < TINY
    a = np.where(tiny, amax * UP, amax)
    q0 = a * C448
    q = fma32(fma32(-q0, np.float32(448), a), C448, q0)
    return np.maximum(np.where(tiny, q * DOWN, q), FLOOR)


def fast_reciprocal(s: np.ndarray, y0: np.ndarray) -> np.ndarray:
    """The candidate's r for a normal s, from the approximation y0."""
    one = np.float32(1)
    y = y0
    for _ in range(2):
        y = fma32(y, fma32(-s, y, one), y)
    bits = s.view(np.uint32)
    ones = (bits & 0x7FFFFF) == 0x7FFFFF
    exact = (((253 - (bits >> 23).astype(np.int64)) << 23) | 1).astype(np.uint32).view(np.float32)
    return np.where(ones, exact, y)


def main() -> None:
    n = 1 << 23
    significands = np.arange(n, dtype=np.uint32)
    for k in (-149, -130, -118, -110, -101, -100, -60, 0, 60, 118):  # amax's binade (-149, -130: subnormal)
        if k < -126:
            amax = (significands[1:] >> (-126 - k)).astype(np.uint32).view(np.float32)  # subnormals
        else:
            amax = (significands | np.uint32((k + 127) << 23)).view(np.float32)
        want = np.maximum(amax / np.float32(448), FLOOR)
        got = fast_scale(amax)
        bad = np.count_nonzero(got.view(np.uint32) != want.view(np.uint32))
        print(f"s = RN(amax / 448), amax in binade 2^{k}: {bad} of {amax.size} differ")
        assert bad == 0
    for k in (-126, -60, 0, 60, 119):
        s = (significands | np.uint32((k + 127) << 23)).view(np.float32)
        want = np.float32(1) / s
        for ulps in (-2, -1, 0, 1, 2):
            y0 = want.copy()
            for _ in range(abs(ulps)):
                y0 = np.nextafter(y0, np.float32(np.inf if ulps > 0 else 0))
            bad = np.count_nonzero(fast_reciprocal(s, y0).view(np.uint32) != want.view(np.uint32))
            print(f"r = RN(1 / s), s in binade 2^{k}, y0 = RN {ulps:+d} ulp: {bad} of {n} differ")
            assert bad == 0
    print("every check passed")


if __name__ == "__main__":
    main()
