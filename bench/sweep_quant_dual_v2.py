"""Candidate one-pass kernels for both 1x128 layouts of x (the trainer's dual-layout quantizer), against the
shipped ``quantize_dual_triton`` and the two single-layout passes (a question for the H200).

The shipped kernel quantizes x^T from column amaxes and moves the *codes* into the transposed layout: the SASS
of that move is byte-wise shared-memory traffic (``LDS.U8`` / ``LDS.U16``), and on the H200 it runs at 1.6 TB/s
against 3.2 for the single-layout pass (docs/benchmarks.md (a)). Candidates, each one program per (128 x 128)
tile and the quantizer's own row function (``quantize_rows``) for both layouts:

* ``trans``: load the tile once, quantize its rows, then quantize the rows of ``tl.trans(tile)`` (the
  transpose of the bf16 tile, left to the compiler);
* ``reload``: quantize the rows of the tile, then load the tile again transposed (the second read hits L2)
  and quantize those rows.

Every candidate is checked bit for bit against ``quantize_reference`` of x and of x.t() before it is timed
under CUDA-graph replay. GPU only (the candidates also run under TRITON_INTERPRET=1 on CPU: ``CHECK_ONLY=1``):

    PYTHONPATH=. OUT=$OUT python3 bench/sweep_quant_dual_v2.py

Result (runs AU and AV, docs/benchmarks.md (a)): ``reload`` with 128-wide chunks and 8 warps, 1.14-1.18x the kernel
before it and 0.97-0.99x the two passes, is now ``quantize_dual_triton`` itself.
"""

import json
import os

import torch
import triton
import triton.language as tl

from jetrl.bench.timing import graph_time_us
from jetrl.fp8.kernels.quant_triton import explicit_round, quantize_dual_triton, quantize_rows, quantize_triton
from jetrl.fp8.quant import E4M3, quantize_reference


@triton.jit
def _dual_candidate(x_ptr, codes_ptr, scales_ptr, codes_t_ptr, scales_t_ptr, M, K, stride_xm, stride_xk,
                    num_k_groups, num_m_groups, POW2: tl.constexpr, EXPLICIT_ROUND: tl.constexpr,
                    RELOAD: tl.constexpr, CHUNK: tl.constexpr):
    pid_k, pid_m = tl.program_id(0), tl.program_id(1)
    rows = pid_m.to(tl.int64) * 128 + tl.arange(0, 128)
    cols = pid_k.to(tl.int64) * 128 + tl.arange(0, 128)
    row_ok, col_ok = rows < M, cols < K
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xk,
                mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    code_bits, scale = quantize_rows(x.to(tl.float32), POW2, EXPLICIT_ROUND)
    tl.store(codes_ptr + rows[:, None] * K + cols[None, :], code_bits, mask=row_ok[:, None] & col_ok[None, :])
    tl.store(scales_ptr + rows * num_k_groups + pid_k, scale, mask=row_ok)
    if RELOAD:  # x^T's rows (K-columns of x), CHUNK at a time, read again (from L2)
        for c in range(128 // CHUNK):
            kc = pid_k.to(tl.int64) * 128 + c * CHUNK + tl.arange(0, CHUNK)
            kc_ok = kc < K
            xt = tl.load(x_ptr + rows[None, :] * stride_xm + kc[:, None] * stride_xk,
                         mask=kc_ok[:, None] & row_ok[None, :], other=0.0)
            code_t, scale_t = quantize_rows(xt.to(tl.float32), POW2, EXPLICIT_ROUND)
            tl.store(codes_t_ptr + kc[:, None] * M + rows[None, :], code_t, mask=kc_ok[:, None] & row_ok[None, :])
            tl.store(scales_t_ptr + kc * num_m_groups + pid_m, scale_t, mask=kc_ok)
    else:
        code_t, scale_t = quantize_rows(tl.trans(x).to(tl.float32), POW2, EXPLICIT_ROUND)
        tl.store(codes_t_ptr + cols[:, None] * M + rows[None, :], code_t, mask=col_ok[:, None] & row_ok[None, :])
        tl.store(scales_t_ptr + cols * num_m_groups + pid_m, scale_t, mask=col_ok)


def dual_candidate(x, pow2, reload, chunk, warps):
    m, k = x.shape
    gm, gk = triton.cdiv(m, 128), triton.cdiv(k, 128)
    codes = torch.empty((m, k), dtype=E4M3, device=x.device)
    scales = torch.empty((m, gk), dtype=torch.float32, device=x.device)
    codes_t = torch.empty((k, m), dtype=E4M3, device=x.device)
    scales_t = torch.empty((k, gm), dtype=torch.float32, device=x.device)
    _dual_candidate[(gk, gm)](x, codes.view(torch.uint8), scales, codes_t.view(torch.uint8), scales_t, m, k,
                              x.stride(0), x.stride(1), gk, gm, POW2=pow2, EXPLICIT_ROUND=explicit_round(),
                              RELOAD=reload, CHUNK=chunk, num_warps=warps)
    return codes, scales, codes_t, scales_t


def bits(t):
    return t.view(torch.uint8) if t.dtype == E4M3 else t.view(torch.int32)


# the first sweep (run AP) also timed ``trans`` at 4 / 8 / 16 warps and ``reload`` at 32 / 4-8 and 64 / 4:
# all slower than ``reload`` 64 / 8 (docs/benchmarks.md (a)); CANDIDATES=all restores them
CANDIDATES = [("reload", True, c, w) for c in (64, 128) for w in (8, 16)]
if os.environ.get("CANDIDATES") == "all":
    CANDIDATES = [("trans", False, 128, w) for w in (4, 8, 16)] + [
        ("reload", True, c, w) for c in (32, 64, 128) for w in (4, 8, 16)]


def main() -> None:
    dev = torch.device("cpu" if os.environ.get("CHECK_ONLY") else "cuda")
    shapes = [(256, 384)] if dev.type == "cpu" else [(9216, 4096), (9216, 6144), (9216, 12288), (9216, 24576)]
    res = []
    for m, k in shapes:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16) * torch.logspace(-3, 3, k, device=dev).to(
            torch.bfloat16)
        x[3, 5] = float("nan")
        for pow2 in (False, True):
            want = (*quantize_reference(x, 1, 128, pow2), *quantize_reference(x.t(), 1, 128, pow2))
            for name, reload, chunk, warps in CANDIDATES:
                got = dual_candidate(x, pow2, reload, chunk, warps)
                ok = all(torch.equal(bits(g), bits(w)) for g, w in zip(got, want))
                row = {"m": m, "k": k, "pow2": pow2, "kind": name, "chunk": chunk, "warps": warps, "bit_equal": ok}
                if dev.type == "cuda" and not pow2:
                    row["us"] = graph_time_us(lambda r=reload, c=chunk, w=warps: dual_candidate(x, False, r, c, w),
                                              dev, calls=5, replays=10)
                res.append(row)
                print(row, flush=True)
        if dev.type == "cuda":
            nbytes = m * k * 4
            for kind, fn in (("shipped dual (64/8)", lambda: quantize_dual_triton(x, False)),
                             ("two passes", lambda: (quantize_triton(x, 1, 128, False),
                                                     quantize_triton(x.t(), 1, 128, False)))):
                res.append({"m": m, "k": k, "pow2": False, "kind": kind,
                            "us": graph_time_us(fn, dev, calls=5, replays=10)})
            for r in res:
                if r["m"] == m and r["k"] == k and "us" in r:
                    r["tb_s"] = nbytes / r["us"] / 1e6
    if dev.type == "cuda":
        with open(os.path.join(os.environ.get("OUT", "."), "quant_dual_v2.json"), "w") as f:
            json.dump(res, f, indent=1)
        print(f"\n{'shape':>12} {'kind':18} {'chunk':>5} {'warps':>5} {'us':>8} {'TB/s':>6} bit-equal")
        for r in res:
            if "us" in r:
                print(f"{r['m']:>5}x{r['k']:<6} {r['kind']:18} {r.get('chunk', ''):>5} {r.get('warps', ''):>5} "
                      f"{r['us']:8.1f} {r['tb_s']:6.2f} {r.get('bit_equal', '')}")
    assert all(r.get("bit_equal", True) for r in res), "a candidate's codes or scales differ from the reference"


if __name__ == "__main__":
    main()
