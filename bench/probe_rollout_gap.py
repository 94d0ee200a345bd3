"""Why a rollout's decode step (bench (e)) is slower than the decode step (bench (d)) at the same mean context.

Bench (e) reads `bf16` at ~13.7 ms and `jet_kv` at ~9.55 ms per step (prefill excluded), (d) 13.1 and 9.0 ms for one
graph replay at mean context 640 -- but (d)'s 256 rows have lengths spread over 128-1152, while a rollout's rows all
have the same length, which walks 128 -> 1152. This probe measures, on one engine per recipe (the 8B's 36 layers,
B = 256, max_len 1153 as in (e)):

* the graph replay at uniform lengths L (one row per L) and at (d)'s spread (mean 640): the mean over L of a
  linear-in-L step equals the spread's step, so a gap there is the attention's (or another kernel's) shape;
* one decode window of the engine (``_decode_window``: the replays plus the sampler and the bookkeeping ops, 8
  steps, every row frozen so the lengths stay put) against 8 bare replays: what a step adds outside its graph;
* the rollout itself, as bench (e) times it (``engine_rollout``, which logs the SM clock and power: gpu_clocks.py);
* the graph step replayed 800 times back to back at uniform length 640, timed per block of 20, under the clock log:
  whether a sustained decode slows as the board meets its power limit (run GA saw 690 W and 1560-1850 MHz during
  both rollouts, against 1980 MHz for short bursts).

GPU only; writes $OUT/probe_rollout_gap.json.

    PYTHONPATH=. OUT=$OUT python3 bench/probe_rollout_gap.py
    SWEEP=1 PYTHONPATH=. OUT=$OUT python3 bench/probe_rollout_gap.py      # lengths 640-1151, two cache strides
"""

import json
import os
from functools import partial

import torch

from jetrl.bench.gpu_clocks import ClockLog
from jetrl.bench.models import free_device_memory, random_model, set_recipe
from jetrl.bench.rollout import engine_rollout, spread_lengths
from jetrl.bench.shapes import h200_config
from jetrl.bench.synthetic import random_prompts
from jetrl.bench.timing import time_ms
from jetrl.engine import Engine, SamplingParams
from jetrl.fp8 import precision_phase

DEV = torch.device("cuda")


def _fill(engine: Engine, config, length: int) -> None:
    """Random K/V at positions [0, length) of every slot and layer (one random draw per chunk, reused by the layers)."""
    hkv, hd = config.num_key_value_heads, config.head_dim
    for start in range(0, engine.max_slots, 32):
        slots = torch.arange(start, min(start + 32, engine.max_slots), device=DEV)
        view = engine.cache.prefill(slots, torch.full((len(slots),), length, device=DEV))
        k = torch.randn(len(slots), hkv, length, hd, device=DEV, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        for layer in range(config.num_hidden_layers):
            view.update(layer, k, v)


def _sustained(step, engine: Engine, batch: int, blocks: int = 40, per_block: int = 20) -> dict:
    """The graph step replayed ``blocks * per_block`` times back to back at uniform length 640 (a rollout's mean
    context), each block event-timed, under the clock log: the first blocks against the last ones."""
    engine.cache.lengths[:batch] = 640
    torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(blocks + 1)]
    with ClockLog(DEV) as clocks:
        events[0].record()
        for i in range(blocks):
            for _ in range(per_block):
                step()
            events[i + 1].record()
        torch.cuda.synchronize()
    ms = [events[i].elapsed_time(events[i + 1]) / per_block for i in range(blocks)]
    return {"first_block_ms": ms[0], "last_10_blocks_ms": sum(ms[-10:]) / 10, "block_ms": ms,
            "gpu": clocks.summary(), "torch_uuid": str(torch.cuda.get_device_properties(DEV).uuid)}


def stride_sweep() -> None:
    """``SWEEP=1``: the graph step at uniform lengths 640-1151 every 32 positions, for caches of several ``max_len``
    (``MAX_LENS``, default 1153 -- bench (e)'s -- and 1280): whether a length's step stands off the line (run GB:
    `bf16` at 896 was ~1 ms above it, `jet_kv` at 1151 ~0.6 ms), and whether the cache's row stride moves it."""
    cfg = h200_config()
    batch, prompt, new = cfg.rollout_batch, cfg.rollout_prompt, cfg.rollout_new
    model = random_model(cfg.model_config(cfg.layers), DEV, torch.bfloat16).requires_grad_(False)
    lengths = list(range(640, prompt + new, 32)) + [prompt + new - 1]
    result = {}
    for recipe in os.environ.get("RECIPES", "bf16,jet_kv").split(","):
        set_recipe(model, recipe)
        for max_len in [int(n) for n in os.environ.get("MAX_LENS", f"{prompt + new + 1},1280").split(",")]:
            engine = Engine(model, max_slots=batch, max_len=max_len)
            with torch.no_grad(), precision_phase("rollout"):
                _fill(engine, model.config, prompt + new - 1)
                step = partial(engine.graphs, batch)
                times = {}
                for n in lengths:
                    engine.cache.lengths[:batch] = n
                    times[n] = time_ms(step, DEV, iters=10, warmup=2)
            result[f"{recipe} max_len={max_len}"] = times
            print(f"{recipe} max_len={max_len}: " + ", ".join(f"{n}: {ms:.2f}" for n, ms in times.items()), flush=True)
            engine = step = None
            free_device_memory()
    with open(os.path.join(os.environ.get("OUT", "."), "probe_rollout_gap_sweep.json"), "w") as f:
        json.dump(result, f, indent=1)


def main() -> None:
    if os.environ.get("SWEEP") == "1":
        return stride_sweep()
    cfg = h200_config()
    batch, prompt, new = cfg.rollout_batch, cfg.rollout_prompt, cfg.rollout_new
    model = random_model(cfg.model_config(cfg.layers), DEV, torch.bfloat16).requires_grad_(False)
    prompts = random_prompts(batch, prompt, cfg.vocab)
    lengths = [prompt, 256, 384, 512, 640, 768, 896, 1024, prompt + new - 1]
    result = {}
    for recipe in os.environ.get("RECIPES", "bf16,jet_kv").split(","):
        set_recipe(model, recipe)
        rollout = engine_rollout(model, recipe, prompts, new, DEV)
        engine = Engine(model, max_slots=batch, max_len=prompt + new + 1)
        row = {"rollout_ms_per_step": rollout["ms_per_step"], "rollout_tok_s": rollout["tok_s"],
               "prefill_s": rollout["prefill_s"], "rollout_gpu": rollout["gpu"], "uniform_ms": {}}
        with torch.no_grad(), precision_phase("rollout"):
            engine._ensure_state()
            _fill(engine, model.config, prompt + new - 1)
            step = partial(engine.graphs, batch)
            for n in lengths:
                engine.cache.lengths[:batch] = n
                row["uniform_ms"][n] = time_ms(step, DEV, iters=10, warmup=2)
            engine.cache.lengths[:batch] = torch.tensor(spread_lengths(batch, 640), device=DEV)
            row["spread_640_ms"] = time_ms(step, DEV, iters=10, warmup=2)
            engine.cache.lengths[:batch] = 640
            row["uniform_640_ms"] = time_ms(step, DEV, iters=10, warmup=2)
            engine.done.fill_(True)  # frozen rows: the window's steps leave the lengths where they are
            params = SamplingParams(temperature=1.0, max_tokens=new, ignore_eos=True, seed=0)
            window = partial(engine._decode_window, batch, 8, params, None)
            row["window_ms_per_step"] = time_ms(window, DEV, iters=5, warmup=1) / 8
            row["replays_ms_per_step"] = time_ms(step, DEV, iters=5, warmup=1, back_to_back=8)
            row["sustained"] = _sustained(step, engine, batch)
        values = list(row["uniform_ms"].values())
        # trapezoid over the measured lengths: the mean step of a rollout whose rows walk prompt -> prompt + new
        xs = lengths
        area = sum((xs[i + 1] - xs[i]) * (values[i] + values[i + 1]) / 2 for i in range(len(xs) - 1))
        row["uniform_mean_ms"] = area / (xs[-1] - xs[0])
        result[recipe] = row
        print(recipe, json.dumps(row), flush=True)
        engine = step = window = None
        free_device_memory()
    print("\nrecipe   rollout  uniform-mean  spread640  uniform640  window/step  replay/step  (ms)")
    for recipe, r in result.items():
        print(f"{recipe:8} {r['rollout_ms_per_step']:7.3f}  {r['uniform_mean_ms']:11.3f}  {r['spread_640_ms']:9.3f}  "
              f"{r['uniform_640_ms']:10.3f}  {r['window_ms_per_step']:11.3f}  {r['replays_ms_per_step']:11.3f}")
        sus = r["sustained"]
        print(f"   rollout clocks {r['rollout_gpu']}")
        print(f"   sustained at 640: first block {sus['first_block_ms']:.3f} ms, last 10 blocks "
              f"{sus['last_10_blocks_ms']:.3f} ms per step; clocks {sus['gpu']}")
        print("   uniform L -> ms: " + ", ".join(f"{n}: {ms:.3f}" for n, ms in r["uniform_ms"].items()))
    with open(os.path.join(os.environ.get("OUT", "."), "probe_rollout_gap.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
