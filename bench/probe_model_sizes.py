"""Bench (f)'s training phase at smaller Qwen3 shapes: where does eager FP8 training stop paying?

At 8B an FP8 Float8Linear fwd+bwd has ~1-5 ms of GPU work per call against ~1-1.4 ms of host work (bench (b),
bench/probe_host_parts.py), so the host hides behind the GPU. A smaller model shrinks the GPU work per call but not
the host's: this runs section (f)'s own code (``jetrl.bench.training.training_phase``: old-logprob forward + one
update of 16 x 1152 tokens, ``jet`` against ``bf16`` in one process) at Qwen3-1.7B and Qwen3-4B shapes (the real
models' layer shapes; untied lm_head). Each size runs twice: as shipped, sibling projections training as one
stacked Function (projection_group.py), with them forced separate (``SEPARATE=0`` skips that arm; code without
the stacked Function runs the first arm only, its own), and with both recipes' decoder layers replayed from CUDA
graphs (jetrl/rl/train_graphs.py; ``GRAPHS=0`` skips that arm). The first two arms run eagerly. ``EAGER_REFRESH=1``
adds a last arm: the graphs with the FP8 weight refresh after each optimizer step run eagerly instead of from its
own graph (jetrl/fp8/refresh_graph.py). ``ARMS`` (comma-separated names) keeps only those arms.

    PYTHONPATH=. OUT=$OUT python3 bench/probe_model_sizes.py          # SIZES=1.7b,4b by default
    SIZES=0.6b,1.7b ARMS=graphs,eager_refresh EAGER_REFRESH=1 PYTHONPATH=. OUT=$OUT python3 bench/probe_model_sizes.py
"""

import contextlib
import json
import os
import unittest.mock
from dataclasses import replace

import torch

from jetrl.bench.shapes import QWEN3_SHAPES, h200_config
from jetrl.bench.training import training_phase
from jetrl.fp8.projection_group import ProjectionGroup


def main() -> None:
    device = torch.device("cuda")
    results = {}
    arms = {"stacked": (contextlib.nullcontext, "off")}
    if hasattr(ProjectionGroup, "trains") and os.environ.get("SEPARATE", "1") == "1":
        arms["separate"] = (lambda: unittest.mock.patch.object(ProjectionGroup, "trains", lambda *a: False), "off")
    if os.environ.get("GRAPHS", "1") == "1":  # CUDA-graphed training layers (jetrl/rl/train_graphs.py), both recipes
        arms["graphs"] = (contextlib.nullcontext, "on")
    if os.environ.get("EAGER_REFRESH", "0") == "1":
        from jetrl.fp8.refresh_graph import WeightRefresh

        arms["eager_refresh"] = (lambda: unittest.mock.patch.object(WeightRefresh, "_refresh_graphed",
                                                                    lambda *a: False), "on")
    if "ARMS" in os.environ:
        arms = {name: arm for name, arm in arms.items() if name in os.environ["ARMS"].split(",")}
    for size in os.environ.get("SIZES", "1.7b,4b").split(","):
        for arm, (context, graphs) in arms.items():
            # the size alone, not bench (f)'s second row
            cfg = replace(h200_config(), small_train=None, train_cuda_graphs=graphs, **QWEN3_SHAPES[size])
            with context():
                rows = training_phase(cfg, device)
            results[f"{size} {arm}"] = rows
            for r in rows:
                print(size, arm, json.dumps({k: r.get(k) for k in ("name", "baseline", "value", "ratio")}), flush=True)
            torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "."), "probe_model_sizes.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
