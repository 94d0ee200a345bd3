"""Is the Gluon block-FP8 GEMM batch-invariant -- a row's bits the same at every M and under every tile configuration?

Exact mode (jetrl/exact.py) needs its forward GEMMs to give a row the same bits in a decode step (M = 64-256) and in
the trainer's forward (M = thousands). Its Triton kernel gets there with one fixed tile; the Gluon kernel
(jetrl/fp8/kernels/gemm_gluon.py) adds a row's groups in order (``acc + P_g * (sa sb)``, each P_g a fresh wgmma over
128 of K) whatever its tile, runs or partitions, so its bits may not depend on the tile at all. If so, exact mode can
run it with the fastest tile per shape. This probe checks that on an 8B layer's four shapes: every configuration at M
= 1, 7, 64, 256, 1000, 9216 (each prefix quantized on its own, as a decode step's rows are) against one
configuration at 9216 rows, with row- and column-major activation scales and with and without PDL; then times the
candidates against the exact Triton kernel and cuBLAS (decode sizes under CUDA-graph replay, 9216 rows with CUDA
events).

    PYTHONPATH=. OUT=$OUT python3 bench/probe_gluon_invariance.py
"""

import json
import os

import torch

from jetrl.bench.shapes import h200_config
from jetrl.bench.timing import graph_time_us, time_ms
from jetrl.fp8.gemm import fp8_gemm, gluon_tiles
from jetrl.fp8.kernels.gemm_exact_triton import gemm_exact
from jetrl.fp8.kernels.gemm_gluon import gemm_mid_m
from jetrl.fp8.kernels.gluon_tiles import GluonConfig
from jetrl.fp8.quant import quantize

DEV, BF = torch.device("cuda"), torch.bfloat16
LAYER = {name: (n, k) for name, k, n in h200_config().layer_gemms()}  # an 8B layer: name -> (N, K)
CONFIGS = [GluonConfig(128, 128, 4, 2), GluonConfig(64, 128, 6, 2), GluonConfig(64, 64, 6, 4),
           GluonConfig(64, 32, 8, 4), GluonConfig(128, 64, 8, 4), GluonConfig(128, 128, 6, 4),
           GluonConfig(64, 128, 4, 4), GluonConfig(128, 32, 6, 2)]
ROWS = (1, 7, 64, 256, 1000, 9216)
BIG = 9216


def main() -> None:
    torch.manual_seed(0)
    rows_out: list = []
    weights, acts = {}, {}
    for name, (n, k) in LAYER.items():
        weights[name] = quantize(torch.randn(n, k, device=DEV, dtype=BF) * 0.02, (128, 128))
        acts[name] = torch.randn(BIG, k, device=DEV, dtype=BF)
    # 1. invariance
    for name, (n, k) in LAYER.items():
        w, x = weights[name], acts[name]
        for col_major in (False, True):
            prefix = {m: quantize(x[:m], col_major_scales=col_major) for m in ROWS}
            a = prefix[BIG]
            ref = gemm_mid_m(a.codes, a.scales, w.codes, w.scales, BF, CONFIGS[0], pdl=False)
            exact = gemm_exact(a.codes, a.scales, w.codes, w.scales, BF)
            differ = {}
            for cfg in CONFIGS:
                for pdl in (False, True):
                    for m in ROWS:
                        am = prefix[m]
                        out = gemm_mid_m(am.codes, am.scales, w.codes, w.scales, BF, cfg, pdl=pdl)
                        if not torch.equal(out, ref[:m]):
                            key = f"{cfg.block_m}x{cfg.block_n}/{cfg.stages}/{cfg.unroll} pdl={int(pdl)} M={m}"
                            differ[key] = int((out != ref[:m]).any(dim=1).sum())
            row = {"what": "invariance", "gemm": name, "col_major_scales": col_major, "configs": len(CONFIGS),
                   "calls": len(CONFIGS) * 2 * len(ROWS), "rows_differing_by_call": differ,
                   "gluon_vs_exact_triton_rel": float((ref.float() - exact.float()).norm() / exact.float().norm()),
                   "gluon_vs_exact_triton_equal_rows": int((ref == exact).all(dim=1).sum())}
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    # 2. speed: a layer's four GEMMs at decode sizes under CUDA graphs, µs
    for m in (16, 64, 256):
        codes = {name: quantize(acts[name][:m]) for name in LAYER}
        row = {"what": "layer's 4 GEMMs, graph us", "M": m}
        kinds = {
            "exact triton": lambda name, c=codes: gemm_exact(c[name].codes, c[name].scales, weights[name].codes,
                                                             weights[name].scales, BF),
            "gluon, fast path's tiles": lambda name, c=codes, m=m: gemm_mid_m(
                c[name].codes, c[name].scales, weights[name].codes, weights[name].scales, BF,
                gluon_tiles(m, *LAYER[name])),
            "fast path (dispatch)": lambda name, c=codes: fp8_gemm(c[name], weights[name]),
        }
        for kind, call in kinds.items():
            for name in LAYER:
                call(name)  # compile, allocate counters
            row[kind] = round(graph_time_us(lambda call=call: [call(nm) for nm in LAYER], DEV, calls=5, replays=10), 1)
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    # 3. speed at the trainer's 9216 rows, ms per GEMM
    for name, (n, k) in LAYER.items():
        a, w = quantize(acts[name]), weights[name]
        row = {"what": "9216 rows, ms", "gemm": name,
               "cublas": time_ms(lambda a=a, w=w: fp8_gemm(a, w), DEV, iters=10, warmup=3),
               "exact triton": time_ms(lambda a=a, w=w: gemm_exact(a.codes, a.scales, w.codes, w.scales, BF), DEV,
                                       iters=10, warmup=3)}
        for cfg in CONFIGS:
            row[f"gluon {cfg.block_m}x{cfg.block_n}/{cfg.stages}/{cfg.unroll}"] = time_ms(
                lambda cfg=cfg, a=a, w=w: gemm_mid_m(a.codes, a.scales, w.codes, w.scales, BF, cfg, pdl=False), DEV,
                iters=10, warmup=3)
        row = {key: (round(v, 4) if isinstance(v, float) else v) for key, v in row.items()}
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "probe_gluon_invariance.json"), "w") as f:
        json.dump(rows_out, f, indent=1)


if __name__ == "__main__":
    main()
