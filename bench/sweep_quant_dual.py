"""The H200 sweep behind the dual-layout quantizer's defaults (``quantize_dual_triton``: chunk,
warps) on a linear layer's activation and gradient shapes, against the two single-layout passes
it replaces (x, then the strided x^T), under CUDA-graph replay. Every configuration is checked
bit for bit against the reference first. GPU only; writes $OUT/quant_dual.json.

    PYTHONPATH=. OUT=/tmp python3 bench/sweep_quant_dual.py
"""

import itertools
import json
import os
import time

import torch

from jetrl.bench.timing import graph_time_us
from jetrl.fp8.kernels.quant_triton import quantize_dual_triton, quantize_triton
from jetrl.fp8.quant import quantize_reference


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t.view(torch.int32)


def main() -> None:
    dev = torch.device("cuda")
    out_dir = os.environ.get("OUT", "/tmp")
    res, t0 = [], time.time()
    for m, k in [(4096, 4096), (4096, 6144), (4096, 24576), (8192, 4096)]:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        want = (*quantize_reference(x, 1, 128, False), *quantize_reference(x.t(), 1, 128, False))
        nbytes = m * k * (2 + 1 + 1)  # read x once, write both code layouts (scales: < 1%)
        sep = graph_time_us(lambda: (quantize_triton(x, 1, 128, False), quantize_triton(x.t(), 1, 128, False)), dev,
                            calls=5, replays=5)
        res.append({"m": m, "k": k, "kind": "two passes", "us": sep, "tb_s": nbytes / sep / 1e6})
        print(res[-1], flush=True)
        best = None
        for chunk, warps in itertools.product((16, 32, 64, 128), (2, 4, 8, 16)):
            try:
                got = quantize_dual_triton(x, False, chunk=chunk, num_warps=warps)
                ok = all(torch.equal(bits(g), bits(w)) for g, w in zip(got, want))
                us = graph_time_us(lambda: quantize_dual_triton(x, False, chunk=chunk, num_warps=warps), dev,
                                   calls=5, replays=5)
            except Exception as e:  # noqa: BLE001 -- e.g. out of registers; the sweep goes on
                print("fail", m, k, chunk, warps, repr(e)[:100])
                continue
            row = {"m": m, "k": k, "kind": "dual", "chunk": chunk, "warps": warps, "us": us,
                   "tb_s": nbytes / us / 1e6, "bit_equal": ok}
            res.append(row)
            if ok and (best is None or us < best["us"]):
                best = row
        print("best", best, "vs two passes", f"{sep / best['us']:.2f}x", flush=True)
    print("time", time.time() - t0)
    json.dump(res, open(f"{out_dir}/quant_dual.json", "w"), indent=1)


if __name__ == "__main__":
    main()
