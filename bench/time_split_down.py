"""down_proj's split-K rule at the RL step's 64 rows, A/B in one process (a question for the H200).

bench/sweep_gemm_gluon.py times the GEMM alone; this times what it is for: the engine's decode step (CUDA-graph
replay, 4 layers of an 8B-shaped Qwen3 + lm_head, B = ``BATCH`` rows, default 64, mean context 640) under
``jet_kv``, with the shipped rule (down in 64 x 64 tiles over two halves of K) and with the rule before it (64 x
32 tiles, no split), alternating, and checks that both give the same sampled tokens. GPU only:

    PYTHONPATH=. python3 bench/time_split_down.py
"""

import os
import time

import torch

import jetrl.fp8.gemm as gemm
from jetrl.bench.models import random_model, set_recipe
from jetrl.bench.rollout import fill_cache, spread_lengths
from jetrl.bench.shapes import h200_config
from jetrl.engine import Engine
from jetrl.fp8 import precision_phase
from jetrl.fp8.kernels.gluon_tiles import GluonConfig

SHIPPED = gemm.gluon_tiles


def unsplit(m, n, k):
    cfg = SHIPPED(m, n, k)
    return GluonConfig(64, gemm.NARROW_BLOCK_N, stages=8, unroll=4) if cfg.split_k > 1 else cfg


def step_ms(model, b, lengths, dev) -> float:
    engine = Engine(model, max_slots=b, max_len=max(lengths) + 2)
    fill_cache(engine.cache, model.config, lengths, dev, torch.bfloat16)
    with torch.no_grad(), precision_phase("rollout"):
        for _ in range(3):
            engine.graphs(b)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            engine.graphs(b)
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / 50 * 1e3


def main() -> None:
    dev = torch.device("cuda")
    b = int(os.environ.get("BATCH", "64"))
    cfg = h200_config(layers=4)
    model = random_model(cfg.model_config(4), dev, torch.bfloat16)
    set_recipe(model, "jet_kv")
    lengths = spread_lengths(b, 640)
    times = {"split (shipped)": [], "unsplit (before)": []}
    for _ in range(3):
        for name, rule in (("split (shipped)", SHIPPED), ("unsplit (before)", unsplit)):
            gemm.gluon_tiles = rule
            times[name].append(step_ms(model, b, lengths, dev))
    gemm.gluon_tiles = SHIPPED
    for name, ts in times.items():
        print(f"{name:18} decode step (4 layers + lm_head, B = {b}): " + " / ".join(f"{t:.4f}" for t in ts) + " ms")


if __name__ == "__main__":
    main()
