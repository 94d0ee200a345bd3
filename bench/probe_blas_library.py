"""cuBLAS against cuBLASLt for the BF16 GEMMs of the decode step, on the H200: is the BF16 baseline leaving speed on
the table by torch's default library choice?

At B = 256 the BF16 decode step's linear layers are ~5.5 of its ~12.4 ms of kernel time (36-layer profile,
``LAYERS=36 RECIPES=bf16 bench/profile_decode_step.py``) and cuBLAS runs ``down`` split-K with a separate reduce
kernel. ``torch.backends.cuda.preferred_blas_library("cublaslt")`` routes the same ``F.linear`` calls through
cuBLASLt, whose heuristics pick other kernels.

1. One 8B layer's BF16 GEMMs (q/k/v and gate/up stacked, as the engine runs them) and the lm_head at M = 64 and 256,
   each under CUDA-graph replay over weight copies that do not stay in L2, per library.
2. The engine's decode step (8B-shaped random Qwen3, 36 layers, mean context 640, B = 256) for ``bf16``, ``jet``
   and ``jet_kv``, its CUDA graph captured under each library (bench/rollout.py ``ab_decode_steps``: timed off, on,
   on, off), with the logits' largest difference between the two.

GPU only; writes $OUT/probe_blas_library.json.

    PYTHONPATH=. OUT=$OUT python3 bench/probe_blas_library.py
"""

import contextlib
import json
import os

import torch
import torch.nn.functional as F

from jetrl.bench.models import random_model
from jetrl.bench.rollout import ABBA, ab_decode_steps
from jetrl.bench.shapes import h200_config
from jetrl.bench.timing import graph_time_us

DEV = torch.device("cuda")
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "lm_head": (151936, 4096)}  # (N, K) of the 8B layer, BF16 baseline stacked


@contextlib.contextmanager
def cublaslt(on: bool):
    previous = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt" if on else "cublas")
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(previous)


def gemm_rows() -> list[dict]:
    rows = []
    for m in (64, 256):
        for name, (n, k) in SHAPES.items():
            copies = 2 if name == "lm_head" else 6  # 6 x 24-201 MB (2 x 1.2 GB) > the 50 MB L2
            weights = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            turn = iter(range(10**9))

            def call(weights=weights, x=x, turn=turn, copies=copies):
                return F.linear(x, weights[next(turn) % copies])

            times = {False: [], True: []}
            for on in ABBA:
                with cublaslt(on):
                    times[on].append(graph_time_us(call, DEV, calls=2 * copies, replays=10))
            cublas, lt = (sum(times[on]) / 2 for on in (False, True))
            rows.append({"gemm": name, "m": m, "cublas_us": cublas, "cublaslt_us": lt})
            print(f"{name:8s} M={m:3d}: cuBLAS {cublas:7.1f} us, cuBLASLt {lt:7.1f} us ({cublas / lt:.3f}x)", flush=True)
            del weights
    return rows


def main() -> None:
    print("torch's default:", torch.backends.cuda.preferred_blas_library())
    results = {"gemms": gemm_rows(), "steps": []}
    cfg = h200_config()
    model = random_model(cfg.model_config(cfg.layers), DEV, torch.bfloat16).requires_grad_(False)
    for r in ab_decode_steps(model, cfg, cublaslt, [256], DEV):
        logits = r.pop("logits")
        r["logits_max_abs_diff"] = float((logits[True] - logits[False]).abs().max())
        results["steps"].append(r)
        print(f"decode step {r['recipe']:7s} B=256: cuBLAS {r['off_ms']:.3f} ms, cuBLASLt {r['on_ms']:.3f} ms "
              f"({r['off_ms'] / r['on_ms']:.4f}x); logits max |diff| {r['logits_max_abs_diff']:.3g}", flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "probe_blas_library.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
