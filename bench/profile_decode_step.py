"""Profile of one engine decode step (CUDA-graph replay, 4 layers of an 8B-shaped Qwen3 + lm_head, or every layer
of a smaller Qwen3's shapes with ``SIZE=0.6b`` / ``1.7b`` / ``4b``; B = ``BATCH`` rows (default 256; section (g)'s
rollout runs 64), mean context ``CONTEXT`` (default 640)) under `bf16`, `jet` and `jet_kv` (``RECIPES``, comma
separated): kernels per step, GPU time per kernel, the GPU's busy time against the replay's wall time, and the idle
gaps between consecutive kernels of one replay (their sum, and the kernel pairs with the most of it). ``LAYERS=36``
profiles every layer of the 8B shape. The evidence behind docs/benchmarks.md section (d). GPU only.

    PYTHONPATH=. python3 bench/profile_decode_step.py
    SIZE=0.6b BATCH=64 PYTHONPATH=. python3 bench/profile_decode_step.py
    LAYERS=36 RECIPES=bf16 PYTHONPATH=. python3 bench/profile_decode_step.py
"""

import collections
import itertools
import os
import time
from dataclasses import replace

import torch
from torch.profiler import ProfilerActivity, profile

from jetrl.bench.models import random_model, set_recipe
from jetrl.bench.rollout import fill_cache, spread_lengths
from jetrl.bench.shapes import QWEN3_SHAPES, h200_config
from jetrl.engine import Engine
from jetrl.fp8 import precision_phase


def main() -> None:
    DEV = torch.device("cuda")
    B = int(os.environ.get("BATCH", "256"))
    size = os.environ.get("SIZE")
    cfg = replace(h200_config(), **QWEN3_SHAPES[size]) if size else h200_config()
    layers = int(os.environ.get("LAYERS", cfg.train_layers if size else 4))
    model = random_model(cfg.model_config(layers), DEV, torch.bfloat16)
    for recipe in os.environ.get("RECIPES", "bf16,jet,jet_kv").split(","):
        set_recipe(model, recipe)
        lengths = spread_lengths(B, int(os.environ.get("CONTEXT", "640")))
        engine = Engine(model, max_slots=B, max_len=max(lengths) + 2)
        fill_cache(engine.cache, model.config, lengths, DEV, torch.bfloat16)
        with torch.no_grad(), precision_phase("rollout"):
            engine.graphs(B)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    engine.graphs(B)
                torch.cuda.synchronize()
        ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        tot = collections.defaultdict(lambda: [0, 0.0])
        for e in ev:
            t = tot[e.name[:70]]
            t[0] += 1
            t[1] += e.device_time
        n = len(ev) / 5
        gpu = sum(v[1] for v in tot.values()) / 5
        print(f"== {recipe}: {n:.0f} kernels per step ({layers} layers + lm_head), GPU busy {gpu:.0f} us per step")
        for name, (c, us) in sorted(tot.items(), key=lambda kv: -kv[1][1])[:22]:
            print(f"{us / 5:9.1f} us {c / 5:5.0f}x  {name}")
        _print_gaps(ev, 5)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            engine.graphs(B)
        torch.cuda.synchronize()
        print("replay ms", (time.perf_counter() - t0) / 20 * 1e3)
        del engine


def _print_gaps(ev: list, replays: int) -> None:
    """Idle time between consecutive kernels inside one replay (the replays' boundaries left out): its sum per step
    and the kernel pairs it falls between."""
    ev = sorted(ev, key=lambda e: e.time_range.start)
    n = len(ev) // replays
    pairs = collections.defaultdict(list)
    for r in range(replays):
        seg = ev[r * n:(r + 1) * n]
        for a, b in itertools.pairwise(seg):
            pairs[(a.name[:40], b.name[:40])].append(b.time_range.start - a.time_range.end)
    total = sum(sum(g) for g in pairs.values()) / replays
    span = sum(ev[(r + 1) * n - 1].time_range.end - ev[r * n].time_range.start for r in range(replays)) / replays
    print(f"   kernel span {span:.0f} us per step, idle gaps between its kernels {total:.0f} us; most of them:")
    for (a, b), gaps in sorted(pairs.items(), key=lambda kv: -sum(kv[1]))[:6]:
        print(f"   {sum(gaps) / replays:8.1f} us over {len(gaps) // replays:3d} gaps: {a} -> {b}")


if __name__ == "__main__":
    main()
