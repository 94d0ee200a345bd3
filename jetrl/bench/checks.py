"""The correctness measures ``jetrl bench`` applies in the same run as its timings.

* quantizers: **bit equality** of codes (uint8 view of the E4M3 bytes) and scales (int32 view
  of the fp32 bits, so NaN scales compare too) against ``quantize_reference`` on the same tensor;
* GEMMs: the relative Frobenius error ``||out - ref|| / ||ref||`` against the emulated GEMM,
  the spec (an accumulation-order difference is ~1e-3; a wrong layout or scale is O(1));
* linear layers: the SQNR ``20 log10(||ref|| / ||out - ref||)`` in dB against an fp32 reference
  (E4M3 with 1x128 / 128x128 scaling gives ~28-29 dB on Gaussian data, design.md §3).

A check is ``"ok"`` or ``"FAILED"`` in a row's ``check`` field; any FAILED row makes
``jetrl bench`` exit non-zero.
"""

from __future__ import annotations

import torch

OK, FAILED = "ok", "FAILED"
GEMM_REL_ERR_MAX = 1e-2  # FP8 kernel output vs the emulated GEMM (bf16 output rounding included)
LINEAR_SQNR_MIN_DB = 25.0  # Float8Linear y, dx, dw vs fp32 (measured 28.8 dB on the H200)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of FP8 codes (uint8) or fp32 scales (int32), for exact comparison."""
    if t.dtype == torch.float8_e4m3fn:
        return t.contiguous().view(torch.uint8)
    if t.dtype == torch.float32:
        return t.contiguous().view(torch.int32)
    return t


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300))


def sqnr_db(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    return float(20 * torch.log10(ref.norm() / (out - ref).norm().clamp_min(1e-300)))


def status(ok: bool) -> str:
    return OK if ok else FAILED
