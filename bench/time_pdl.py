"""Programmatic dependent launch (jetrl/fp8/kernels/pdl.py) on and off, same process, on the GPU:

1. the decode GEMMs of one 8B layer (a ``jet`` Float8Linear forward in the rollout phase: activation quant
   + GEMM), sum of the four, CUDA-graph replay, at M = 1, 16, 64, 256 -- bench section (c)'s ``fp8`` column;
2. the engine's decode step (CUDA graph, 8B-shaped random Qwen3, 36 layers) for ``bf16``, ``jet`` and
   ``jet_kv`` at B = 256 (mean context 640, bench (d)) and B = 64 (the RL step's rollout batch).

Every PDL-on result is compared with the PDL-off one bit for bit (GEMM outputs, the step's logits).
Each configuration is timed off, on, off, on and the medians of each pair are kept. GPU only; writes
$OUT/time_pdl.json.

    PYTHONPATH=. OUT=/tmp python3 bench/time_pdl.py
"""

import json
import os
import statistics
from functools import partial

import torch
import torch.nn.functional as F

from jetrl.bench.kernels import _decode_layer, _in_turn
from jetrl.bench.models import free_device_memory, random_model, set_recipe
from jetrl.bench.rollout import _decode_state, spread_lengths
from jetrl.bench.shapes import h200_config
from jetrl.bench.timing import graph_time_us, time_ms
from jetrl.fp8 import precision_phase
from jetrl.fp8.kernels.pdl import use_pdl

DEV = torch.device("cuda")


def ab(measure) -> tuple[float, float]:
    """(off, on): each the mean of two measurements, taken off, on, off, on."""
    times = {False: [], True: []}
    for on in (False, True, False, True):
        with use_pdl(on):
            times[on].append(measure())
    return statistics.mean(times[False]), statistics.mean(times[True])


def gemms(cfg, results):
    sums = {m: [0.0, 0.0, 0.0] for m in cfg.decode_ms}
    for name, k, n in cfg.layer_gemms():
        torch.manual_seed(0)
        layers = [_decode_layer(name, n, k, DEV) for _ in range(max(2, -(-150_000_000 // (n * k))))]
        for m in cfg.decode_ms:
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            with torch.no_grad(), precision_phase("rollout"):
                outs = {}
                for on in (False, True):
                    with use_pdl(on):
                        outs[on] = layers[0][2](x)
                assert torch.equal(outs[False], outs[True]), f"{name} M={m}: PDL changed the GEMM's output"
                bf16 = graph_time_us(_in_turn([partial(F.linear, x, w) for w, _, _ in layers]), DEV, calls=20,
                                     replays=10)
                off, on = ab(lambda: graph_time_us(_in_turn([partial(mod, x) for _, _, mod in layers]), DEV,
                                                   calls=20, replays=10))
            results.append({"what": f"gemm {name}", "m": m, "bf16_us": bf16, "off_us": off, "on_us": on})
            for i, v in enumerate((bf16, off, on)):
                sums[m][i] += v
            print(f"{name:8s} M={m:3d} bf16 {bf16:6.1f}  fp8 PDL off {off:6.1f} on {on:6.1f} us", flush=True)
        del layers
        free_device_memory()
    for m, (bf16, off, on) in sums.items():
        results.append({"what": "gemm sum of 4", "m": m, "bf16_us": bf16, "off_us": off, "on_us": on})
        print(f"sum of 4 M={m:3d}: bf16 {bf16:.1f}, fp8 off {off:.1f} ({bf16 / off:.2f}x), "
              f"on {on:.1f} ({bf16 / on:.2f}x) us", flush=True)


def steps(cfg, results):
    model = random_model(cfg.model_config(cfg.layers), DEV, torch.bfloat16).requires_grad_(False)
    for batch in (256, 64):
        lengths = spread_lengths(batch, cfg.decode_context)
        for recipe in ("bf16", "jet", "jet_kv"):
            set_recipe(model, recipe)
            logits, engines = {}, {}
            with torch.no_grad(), precision_phase("rollout"):
                for on in (False, True):
                    torch.manual_seed(0)
                    with use_pdl(on):
                        engines[on] = _decode_state(model, batch, lengths, DEV)
                        logits[on] = engines[on].graphs(batch)[:batch].clone()  # captured under this setting
                same = torch.equal(logits[False], logits[True])
                measured = {on: [] for on in (False, True)}
                for on in (False, True, False, True):
                    measured[on].append(time_ms(partial(engines[on].graphs, batch), DEV, iters=20, warmup=2))
            off, on = statistics.mean(measured[False]), statistics.mean(measured[True])
            results.append({"what": f"decode step {recipe}", "batch": batch, "off_ms": off, "on_ms": on,
                            "logits_bit_equal": same})
            print(f"decode step {recipe:7s} B={batch:3d}: PDL off {off:.3f} ms, on {on:.3f} ms "
                  f"({off / on:.3f}x); logits bit-equal {same}", flush=True)
            assert same, f"{recipe} B={batch}: PDL changed the decode step's logits"
            engines = None
            free_device_memory()
    del model
    free_device_memory()


def main() -> None:
    cfg = h200_config()
    results: list[dict] = []
    gemms(cfg, results)
    steps(cfg, results)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "time_pdl.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
