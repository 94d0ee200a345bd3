"""The FP8 weight refresh after an optimizer step: eager against one CUDA-graph replay (jetrl/fp8/refresh_graph.py).

What it times, per size (Qwen3 layer shapes, ``jet``, one process): a model whose decoder layers are graphed for
training (jetrl/rl/train_graphs.py; one micro-batch of 2 x 256 tokens captured), then, after each simulated optimizer
step (every decoder weight written in place, as AdamW does), everything that brings the FP8 buffers the graphs read
up to date before the next replay: ``refresh_weight_caches`` plus the next replay's rereads (the transposed copies)
when eager, ``WeightRefresh.refresh`` plus the same (now empty) check when graphed, as the trainer runs them. Wall
time from a synchronized start to a synchronized end, median of two blocks of ``REPS`` per arm (alternated; each
block's first call, a capture for the graph, left out); and whether the graphed buffers hold the eager bits.

    SIZES=0.6b,1.7b,8b REPS=20 PYTHONPATH=. OUT=$OUT python3 bench/time_weight_refresh.py
"""

import json
import os
import statistics
import time
from dataclasses import replace

import torch

from jetrl.bench.models import random_model
from jetrl.bench.shapes import QWEN3_SHAPES, h200_config
from jetrl.fp8 import convert_to_float8, get_recipe, refresh_weight_caches
from jetrl.fp8.quant import quantize
from jetrl.fp8.refresh_graph import WeightRefresh
from jetrl.rl.train_graphs import TrainingGraphs


def time_size(size: str, device: torch.device, reps: int) -> dict:
    cfg = replace(h200_config(), **QWEN3_SHAPES[size])
    model = convert_to_float8(random_model(cfg.model_config(cfg.train_layers), device, torch.bfloat16),
                              get_recipe("jet"))
    graphs, refresh = TrainingGraphs(model), WeightRefresh(model)
    ids = torch.randint(0, cfg.vocab, (2, 256), device=device)
    graphs.hidden_states(ids).float().sum().backward()
    layers = list(model.model.layers.parameters())

    def one(eager: bool) -> float:
        with torch.no_grad():
            for p in layers:  # a new version of every weight, in place (values kept: AdamW-like writes)
                p.mul_(1.0)
        torch.cuda.synchronize()
        start = time.perf_counter()
        if eager:
            refresh_weight_caches(model)
        elif refresh.refresh():
            graphs.assume_current(refresh.keys)
        graphs._prepare()  # what the next replay does first: the transposed copies, when eager
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3

    times = {"eager": [], "graph": []}
    for _ in range(2):  # two rounds of blocks: an eager refresh touches every cache, so the graph's next
        for arm in ("eager", "graph"):  # refresh captures again -- each block's first call is left out
            block = [one(arm == "eager") for _ in range(1 + reps)]
            times[arm] += block[1:]
    bits = all(torch.equal(e.blocks.codes.view(torch.uint8), quantize(
        e.args[0].detach(), e.args[1].block, pow2_scale=e.args[1].pow2_scale).codes.view(torch.uint8))
        for e in graphs._reads.values() if e.kind == "W")
    row = {"weights": sum(e.kind == "W" for e in graphs._reads.values()), "buffers": len(graphs._reads),
           "eager_ms": statistics.median(times["eager"]), "graph_ms": statistics.median(times["graph"]),
           "captures": refresh.num_captures, "replays": refresh.num_replays, "bits_equal": bits}
    row["speedup"] = row["eager_ms"] / row["graph_ms"]
    return row


def main() -> None:
    device = torch.device("cuda")
    reps = int(os.environ.get("REPS", "20"))
    results = {}
    for size in os.environ.get("SIZES", "0.6b,1.7b,8b").split(","):
        results[size] = time_size(size, device, reps)
        print(size, json.dumps(results[size]), flush=True)
        torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "."), "time_weight_refresh.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
