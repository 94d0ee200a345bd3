"""Bench (c)'s decode GEMMs at smaller Qwen3 shapes: does the per-shape FP8 backend rule, tuned on the 8B's layer,
pick the fastest kernel there too?

Runs section (c)'s own ``decode_gemms`` (every FP8 backend and BF16 timed under CUDA-graph replay, weights rotated
past the L2, each checked against the emulation) on the layer shapes of ``SIZES`` (Qwen3 0.6B / 1.7B / 4B / 8B) at
``ROWS`` (default 1, 16, 64, 128, 256), and prints per GEMM the rule's pick, its time and the fastest backend's.

    SIZES=0.6b,1.7b PYTHONPATH=. OUT=$OUT python3 bench/probe_small_gemms.py
"""

import json
import os
from dataclasses import replace

import torch

from jetrl.bench.kernels import decode_gemms
from jetrl.bench.shapes import QWEN3_SHAPES, h200_config

BACKENDS = ("triton", "gluon", "scaled_mm")


def main() -> None:
    rows_m = tuple(int(m) for m in os.environ.get("ROWS", "1,16,64,128,256").split(","))
    results = {}
    for size in os.environ.get("SIZES", "0.6b,1.7b").split(","):
        cfg = replace(h200_config(), **QWEN3_SHAPES[size], decode_ms=rows_m)
        rows = decode_gemms(cfg, torch.device("cuda"))
        results[size] = rows
        for r in rows:
            if "pick" not in r:
                continue
            times = {b: r.get(f"{b}_us") for b in BACKENDS if r.get(f"{b}_us") is not None}
            best = min(times, key=times.get)
            print(json.dumps({"size": size, "gemm": r["name"].split()[2], "m": r["m"], "n": r["n"], "k": r["k"],
                              "bf16": round(r["baseline"], 2), "pick": r["pick"],
                              "module": round(r["value"], 2), "best": best,
                              **{b: round(t, 2) for b, t in times.items()}, "check": r["check"]}), flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "probe_small_gemms.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
