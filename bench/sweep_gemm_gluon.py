"""The Gluon mid-M block-FP8 GEMM against cuBLAS, the Triton small-M kernel and BF16 (a question for the H200).

For each GEMM of one 8B layer and each M (``SWEEP_ROWS``, default 64,128,256), this checks every
Gluon tile configuration (``SWEEP_CONFIGS``: block_m/block_n/stages/unroll, comma separated) against
the emulated GEMM (relative error, bound 2e-3) and times it under CUDA-graph replay next to BF16,
cuBLAS block FP8 and (M <= 64) the shipped Triton kernel. Weights rotate over copies (3x the L2),
as in bench (c); the activation's quantization is not timed (the same for every FP8 column). GPU only:

    PYTHONPATH=. OUT=$OUT python3 bench/sweep_gemm_gluon.py
"""

import json
import os
import sys

import torch

from jetrl.bench.kernels import rotating_weights, taking_turns
from jetrl.bench.shapes import h200_config
from jetrl.bench.timing import graph_time_us
from jetrl.fp8.gemm import _scaled_mm, gemm_emulated
from jetrl.fp8.kernels.gemm_gluon import gemm_mid_m
from jetrl.fp8.kernels.gemm_triton import gemm_small_m
from jetrl.fp8.kernels.gluon_tiles import GluonConfig
from jetrl.fp8.quant import BLOCK, quantize

DEV = torch.device("cuda")
REL_BOUND = 2e-3


def configs() -> list[GluonConfig]:
    text = os.environ.get("SWEEP_CONFIGS", "64/128/6/2,128/128/4/2,128/128/6/2,128/64/8/4,64/64/6/4,128/64/6/4")
    return [GluonConfig(*(int(v) for v in c.split("/"))) for c in text.split(",")]


def main() -> None:
    cfg = h200_config()
    rows = [int(m) for m in os.environ.get("SWEEP_ROWS", "64,128,256").split(",")]
    results = []
    torch.manual_seed(0)
    for name, k, n in cfg.layer_gemms():
        weights, bf16_w = rotating_weights(n, k, DEV)
        for m in rows:
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            a = quantize(x, (1, BLOCK), col_major_scales=True)
            ref = gemm_emulated(a, weights[0], torch.float32)

            def timed(fn, pool):
                return graph_time_us(taking_turns(fn, pool), DEV, calls=len(pool), replays=20)

            row = {"gemm": name, "M": m, "N": n, "K": k}
            row["bf16_us"] = timed(lambda w: x @ w.t(), bf16_w)
            row["cublas_us"] = timed(lambda w: _scaled_mm(a, w, torch.bfloat16), weights)
            if m <= 64:
                row["triton_us"] = timed(lambda w: gemm_small_m(a.codes, a.scales, w.codes, w.scales), weights)
            for c in configs():
                key = f"{c.block_m}/{c.block_n}/{c.stages}/{c.unroll}"
                try:
                    out = gemm_mid_m(a.codes, a.scales, weights[0].codes, weights[0].scales, config=c).float()
                    err = float((out - ref).norm() / ref.norm())
                    row[f"{key}_rel_err"] = err
                    if not err < REL_BOUND:
                        row[f"{key}_us"] = None
                        print(f"  {name} M={m} {key}: rel err {err:.2e} above {REL_BOUND}", flush=True)
                        continue
                    row[f"{key}_us"] = timed(
                        lambda w, c=c: gemm_mid_m(a.codes, a.scales, w.codes, w.scales, config=c), weights)
                except Exception as exc:  # noqa: BLE001 -- a sweep reports every configuration it can
                    row[f"{key}_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                    print(f"  {name} M={m} {key}: {row[f'{key}_error']}", flush=True)
            results.append(row)
            print(row, flush=True)
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "sweep_gemm_gluon.json"), "w") as f:
        json.dump(results, f, indent=1)
    keys = [f"{c.block_m}/{c.block_n}/{c.stages}/{c.unroll}" for c in configs()]
    print(f"\n{'gemm':8} {'M':>4} {'bf16':>7} {'cublas':>7} {'triton':>7} " + " ".join(k.rjust(12) for k in keys))
    for r in results:
        cells = " ".join(f"{r[k + '_us']:12.1f}" if r.get(k + "_us") else f"{'-':>12}" for k in keys)
        base = f"{r['bf16_us']:7.1f} {r['cublas_us']:7.1f} {r.get('triton_us', 0):7.1f}"
        print(f"{r['gemm']:8} {r['M']:4d} {base} {cells}")
    for m in rows:
        of_m = [r for r in results if r["M"] == m]

        def total(key):
            vals = [r.get(key + "_us") for r in of_m]
            return sum(vals) if all(vals) else None

        best_per_shape = sum(min(r[k + "_us"] for k in keys if r.get(k + "_us")) for r in of_m
                             if any(r.get(k + "_us") for k in keys))
        print(f"sum M={m}: bf16 {total('bf16'):.1f}  cublas {total('cublas'):.1f}  triton {total('triton')}  "
              + "  ".join(f"{k} {total(k)}" for k in keys) + f"  best gluon per shape {best_per_shape:.1f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
