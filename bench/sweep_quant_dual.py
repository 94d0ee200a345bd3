"""An H200 sweep of the dual-layout quantizer's tiles (``quantize_dual_triton``: chunk, warps; its defaults come
from bench/sweep_quant_dual_v2.py, which also times the kernel's design against others) on a linear layer's
activation and gradient shapes, against the two single-layout passes
it replaces (x, then the strided x^T), under CUDA-graph replay. Every configuration is checked
bit for bit against the reference first. Then, eagerly (where the host's per-call work counts, as in
training), the shipped tiles against others and the two passes: both layouts of x and dy, and a Float8Linear
forward+backward using each. GPU only; writes $OUT/quant_dual.json.

    PYTHONPATH=. OUT=/tmp python3 bench/sweep_quant_dual.py
"""

import itertools
import json
import os
import time

import torch
import torch.nn as nn

from jetrl.bench.timing import graph_time_us, time_ms
from jetrl.fp8 import Float8Linear, get_recipe
from jetrl.fp8 import linear as linear_module
from jetrl.fp8.kernels.quant_triton import quantize_dual_triton, quantize_triton
from jetrl.fp8.quant import BLOCK, quantize, quantize_reference, quantize_with_transpose


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t.view(torch.int32)


def main() -> None:
    dev = torch.device("cuda")
    out_dir = os.environ.get("OUT", "/tmp")
    res, t0 = [], time.time()
    for m, k in [(9216, 4096), (9216, 6144), (9216, 12288), (9216, 24576)]:  # x and dy at 8 x 1152 tokens
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        want = (*quantize_reference(x, 1, 128, False), *quantize_reference(x.t(), 1, 128, False))
        nbytes = m * k * (2 + 1 + 1)  # read x once, write both code layouts (scales: < 1%)
        sep = graph_time_us(lambda: (quantize_triton(x, 1, 128, False), quantize_triton(x.t(), 1, 128, False)), dev,
                            calls=5, replays=5)
        res.append({"m": m, "k": k, "kind": "two passes", "us": sep, "tb_s": nbytes / sep / 1e6})
        print(res[-1], flush=True)
        best = None
        for chunk, warps in itertools.product((32, 64, 128), (2, 4, 8, 16)):
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
    res += eager_rows(dev)
    print("time", time.time() - t0)
    json.dump(res, open(f"{out_dir}/quant_dual.json", "w"), indent=1)


def two_passes(x: torch.Tensor, *, pow2_scale: bool = False, check_finite: bool = False, name: str = "t"):
    return (quantize(x, (1, BLOCK), pow2_scale=pow2_scale, name=name),
            quantize(x.t(), (1, BLOCK), pow2_scale=pow2_scale, name=name + "_t"))


# the eager A/B: the shipped tiles, other tiles, and the two plain passes
EAGER_CONFIGS = (("fused 64/8", 64, 8), ("fused 128/8", 128, 8), ("two passes", 0, 0))


def eager_rows(dev: torch.device) -> list[dict]:
    """Eager ms of both layouts of x and dy, and of a Float8Linear fwd+bwd, per configuration
    (EAGER_CONFIGS), at the trainer's micro-batch of 8 x 1152 tokens."""
    from functools import partial

    from jetrl.fp8.kernels import quant_triton

    timer = {"device": dev, "iters": 20, "warmup": 5, "back_to_back": 10}
    shipped = quant_triton.quantize_dual_triton
    rows = []
    for m, k, n in [(9216, 4096, 6144), (9216, 4096, 4096), (9216, 4096, 24576), (9216, 12288, 4096)]:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
        bf16 = nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
        fp8 = Float8Linear.from_float(bf16, get_recipe("jet"), name="sweep")
        xg = x.clone().requires_grad_()

        def fwd_bwd(mod: nn.Module):
            def run() -> None:
                mod.weight.grad, xg.grad = None, None
                mod(xg).backward(dy)
            return run

        row = {"m": m, "k": k, "n": n, "kind": "eager", "bf16_fwd_bwd_ms": time_ms(fwd_bwd(bf16), **timer)}
        for label, chunk, warps in EAGER_CONFIGS:
            dual = two_passes if not chunk else quantize_with_transpose
            if chunk:
                quant_triton.quantize_dual_triton = partial(shipped, chunk=chunk, num_warps=warps)
            try:
                row[f"{label} quant_ms"] = time_ms(lambda dual=dual: (dual(x), dual(dy)), **timer)
                linear_module.quantize_with_transpose = dual
                row[f"{label} fwd_bwd_ms"] = time_ms(fwd_bwd(fp8), **timer)
            finally:
                linear_module.quantize_with_transpose = quantize_with_transpose
                quant_triton.quantize_dual_triton = shipped
        rows.append(row)
        print(row, flush=True)
    return rows


if __name__ == "__main__":
    main()
