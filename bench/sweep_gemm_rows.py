"""H200 sweep of the Triton block-FP8 GEMM's tiles at rollout batch sizes (M = 128, 256), against
cuBLAS block FP8 (``scaled_mm``) and BF16 ``F.linear``, on the four decode GEMMs of an 8B layer.
The evidence behind ``small_m_config`` for M > 64 and the dispatch rule in jetrl/fp8/gemm.py.
GPU only; writes $OUT/sweep_gemm_rows.json and prints the best configurations last.

    PYTHONPATH=. OUT=/tmp python3 bench/sweep_gemm_rows.py

The grid can be narrowed or moved from the environment: SWEEP_ROWS, SWEEP_BLOCK_M, SWEEP_BLOCK_N,
SWEEP_SPLIT_K, SWEEP_WARPS, SWEEP_STAGES (comma-separated integers), e.g. for the decode sizes
``SWEEP_ROWS=16,64 SWEEP_BLOCK_M=16,64 SWEEP_BLOCK_N=64,128,256 SWEEP_SPLIT_K=1,2,4,8``.

Timing: CUDA-graph replay of 20 back-to-back calls that rotate over weight copies (>= 150 MB in
all, 3x the L2), so no call reads the previous call's weight from L2. Every configuration is
checked against the emulated GEMM (relative error < 2e-3) before it is timed.
"""

import itertools
import json
import os
import time

import torch
import torch.nn.functional as F

from jetrl.bench.kernels import _in_turn
from jetrl.bench.timing import graph_time_us
from jetrl.fp8.gemm import _scaled_mm, gemm_emulated
from jetrl.fp8.kernels.gemm_triton import SmallMConfig, gemm_small_m
from jetrl.fp8.quant import quantize

SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288)]
def _ints(name: str, default: tuple[int, ...]) -> tuple[int, ...]:
    """A comma-separated override from the environment, e.g. SWEEP_ROWS=16,64."""
    value = os.environ.get(name)
    return tuple(int(v) for v in value.split(",")) if value else default


ROWS = _ints("SWEEP_ROWS", (128, 256))
BLOCK_M = _ints("SWEEP_BLOCK_M", (64, 128, 256))
BLOCK_N = _ints("SWEEP_BLOCK_N", (64, 128))
SPLIT_K = _ints("SWEEP_SPLIT_K", (1, 2, 4))
WARPS = _ints("SWEEP_WARPS", (4, 8))
STAGES = _ints("SWEEP_STAGES", (3, 4))


def graph_us(fns, calls=20, reps=10):
    """Per-call µs of ``fns[0]()``, ``fns[1]()``, ... in turn, ``calls`` of them captured in one CUDA graph."""
    return graph_time_us(_in_turn(fns), torch.device("cuda"), calls=calls, replays=reps)


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def main() -> None:
    out_dir = os.environ.get("OUT", "/tmp")
    torch.manual_seed(0)
    results, best = [], {}
    t0 = time.time()
    for name, n, k in SHAPES:
        copies = max(2, -(-150_000_000 // (n * k)))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        wq = [quantize(w, (128, 128)) for w in weights]
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq = quantize(x)
            ref = gemm_emulated(xq, wq[0], torch.float32)
            base = {"shape": name, "m": m, "n": n, "k": k}
            bf16 = graph_us([lambda w=w: F.linear(x, w) for w in weights])
            cublas = graph_us([lambda q=q: _scaled_mm(xq, q, torch.bfloat16) for q in wq])
            results.append({**base, "kind": "bf16", "us": bf16})
            results.append({**base, "kind": "cublas_fp8", "us": cublas})
            rows = []
            for bm, bn, sk, nw, ns in itertools.product(BLOCK_M, BLOCK_N, SPLIT_K, WARPS, STAGES):
                cfg = SmallMConfig(bm, bn, sk, nw, ns)
                try:
                    got = gemm_small_m(xq.codes, xq.scales, wq[0].codes, wq[0].scales, torch.float32, config=cfg)
                    err = rel_err(got, ref)
                    if not err < 2e-3:
                        raise AssertionError(f"rel err {err:.1e}")
                    us = graph_us([lambda q=q: gemm_small_m(xq.codes, xq.scales, q.codes, q.scales, torch.bfloat16,
                                                            config=cfg) for q in wq])
                    rows.append({**base, "kind": "triton", "config": [bm, bn, sk, nw, ns], "us": us})
                except Exception as exc:  # noqa: BLE001 -- too much shared memory, etc.: recorded
                    rows.append({**base, "kind": "triton", "config": [bm, bn, sk, nw, ns], "error": str(exc)[:120]})
            results += rows
            ok = [r for r in rows if "us" in r]
            top = sorted(ok, key=lambda r: r["us"])[:5]
            best[f"{name} M={m}"] = {"bf16_us": bf16, "cublas_fp8_us": cublas,
                                     "floor_us": (n * k + n * k // 16384 * 4) / 4.3e12 * 1e6,
                                     "top": [(r["config"], round(r["us"], 1)) for r in top]}
            print(f"{name:8s} M={m:3d} bf16 {bf16:6.1f} cublas {cublas:6.1f} | best triton "
                  + ", ".join(f"{r['config']} {r['us']:.1f}" for r in top[:3]) + f"  ({time.time() - t0:.0f}s)",
                  flush=True)
    with open(os.path.join(out_dir, "sweep_gemm_rows.json"), "w") as f:
        json.dump({"results": results, "best": best}, f, indent=1)
    # The best single configuration per M over the four shapes (sum of µs), for a fixed rule.
    for m in ROWS:
        sums = {}
        for r in results:
            if r["kind"] == "triton" and r["m"] == m and "us" in r:
                sums.setdefault(tuple(r["config"]), []).append(r["us"])
        full = {c: sum(v) for c, v in sums.items() if len(v) == len(SHAPES)}
        ranked = sorted(full.items(), key=lambda kv: kv[1])[:5]
        bf = sum(r["us"] for r in results if r["kind"] == "bf16" and r["m"] == m)
        cb = sum(r["us"] for r in results if r["kind"] == "cublas_fp8" and r["m"] == m)
        print(f"M={m}: sum bf16 {bf:.1f} cublas {cb:.1f}; best one-config triton sums: "
              + ", ".join(f"{list(c)} {s:.1f}" for c, s in ranked))


if __name__ == "__main__":
    main()
