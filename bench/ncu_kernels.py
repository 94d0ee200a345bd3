"""The kernels whose bounds docs/benchmarks.md could not name, once each, for Nsight Compute's hardware counters.

Timing variants told us *that* the fused two-layout quantization stops at ~2.2 TB/s and the Gluon GEMM at ~50% of
the FP8 peak on wide layers, not *why*. The H200 machines now run ncu with counters, so this script runs each such
kernel once, after a warm-up, between ``cudaProfilerStart``/``Stop``, next to its baselines (a plain copy of the
same bytes, cuBLAS's block-FP8 GEMM on the same operands):

    ncu --clock-control none --profile-from-start off --set full -o $OUT/kernels \\
        env PYTHONPATH=. python3 bench/ncu_kernels.py
    ncu --import $OUT/kernels.ncu-rep --page details > $OUT/kernels.txt

The script prints each launch's name after it, in the order ncu profiles them (a launch may be several kernels:
cuBLAS's operand padding before its GEMM). Without ncu it only checks that every launch runs.
"""

from collections.abc import Callable

import torch

from jetrl.bench.shapes import h200_config
from jetrl.fp8.gemm import _scaled_mm
from jetrl.fp8.kernels.gemm_gluon import gemm_mid_m
from jetrl.fp8.kernels.gemm_triton import gemm_small_m
from jetrl.fp8.kernels.gluon_tiles import GluonConfig
from jetrl.fp8.kernels.quant_triton import quantize_dual_triton, quantize_triton
from jetrl.fp8.quant import quantize

DEV, BF = torch.device("cuda"), torch.bfloat16
LAYER = {name: (n, k) for name, k, n in h200_config().layer_gemms()}  # an 8B layer: name -> (N, K)
TOKENS = 9216  # the trainer's micro-batch (8 x 1152)


def launches() -> list[tuple[str, Callable[[], object]]]:
    torch.manual_seed(0)
    x = torch.randn(TOKENS, 4096, device=DEV, dtype=BF)
    y = torch.empty_like(x)
    w = {name: quantize(torch.randn(n, k, device=DEV, dtype=BF) * 0.02, (128, 128)) for name, (n, k) in LAYER.items()}
    a = {(name, m): quantize(torch.randn(m, k, device=DEV, dtype=BF)) for name, (_, k) in LAYER.items()
         for m in (1, 256, TOKENS)}
    big = GluonConfig(128, 128, 4, 2)

    def gluon(name, m, cfg=None):
        return lambda: gemm_mid_m(a[name, m].codes, a[name, m].scales, w[name].codes, w[name].scales, BF, cfg,
                                  pdl=False)

    return [
        ("copy 9216x4096 bf16", lambda: y.copy_(x)),
        ("quant 1x128 9216x4096", lambda: quantize_triton(x, 1, 128, True)),
        ("quant 1x128 of x.t()", lambda: quantize_triton(x.t(), 1, 128, True)),
        ("quant dual 9216x4096", lambda: quantize_dual_triton(x, True)),
        ("gluon gate_up M=256 128x128/4/2", gluon("gate_up", 256, big)),
        ("cublas gate_up M=256", lambda: _scaled_mm(a["gate_up", 256], w["gate_up"], BF)),
        ("gluon o M=256 shipped", gluon("o", 256)),
        ("gluon down M=256 shipped", gluon("down", 256)),
        ("gluon gate_up M=9216 128x128/4/2", gluon("gate_up", TOKENS, big)),
        ("cublas gate_up M=9216", lambda: _scaled_mm(a["gate_up", TOKENS], w["gate_up"], BF)),
        ("triton small-M gate_up M=1", lambda: gemm_small_m(a["gate_up", 1].codes, a["gate_up", 1].scales,
                                                           w["gate_up"].codes, w["gate_up"].scales, BF)),
        ("triton small-M o M=1", lambda: gemm_small_m(a["o", 1].codes, a["o", 1].scales, w["o"].codes,
                                                     w["o"].scales, BF)),
    ]


def main() -> None:
    todo = launches()
    for _, fn in todo:  # compile, allocate the split-K counters, warm the caches
        fn()
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for name, fn in todo:
        fn()
        torch.cuda.synchronize()
        print(name, flush=True)
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
