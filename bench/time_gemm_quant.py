"""The small-M GEMM that quantizes its own input (``gemm_small_m_quantizing``) against ``quantize`` + the
GEMM (two launches), on the GPU, at the decode GEMMs of an 8B layer (M = 1, 16, 64), and the engine's
decode step (36 layers, mean context 640) with and without it at B = 16 and B = 64.

Every call rotates over weight copies (>= 150 MB, 3x the L2) *and* input copies, so no call reuses the
previous call's quantized input (Float8Linear memoizes it per input tensor). Each fused result is
checked bit for bit against the two-launch path first. GPU only; writes $OUT/time_gemm_quant.json.

    PYTHONPATH=. OUT=/tmp python3 bench/time_gemm_quant.py
"""

import contextlib
import json
import os
import statistics
from functools import partial
from unittest import mock

import torch

from jetrl.bench.kernels import _in_turn
from jetrl.bench.models import free_device_memory, random_model, set_recipe
from jetrl.bench.rollout import _decode_state, spread_lengths
from jetrl.bench.shapes import h200_config
from jetrl.bench.timing import graph_time_us, time_ms
from jetrl.fp8 import gemm as gemm_module
from jetrl.fp8 import precision_phase
from jetrl.fp8.kernels.gemm_triton import gemm_small_m, gemm_small_m_quantizing
from jetrl.fp8.quant import quantize

DEV = torch.device("cuda")


def bits(t):
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.uint8)


def gemms(cfg, results):
    sums = {}
    for name, k, n in cfg.layer_gemms():
        torch.manual_seed(0)
        copies = max(2, -(-150_000_000 // (n * k)))
        weights = [quantize(torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02, (128, 128))
                   for _ in range(copies)]
        for m in (1, 16, 64):
            xs = [torch.randn(m, k, device=DEV, dtype=torch.bfloat16) for _ in range(copies)]
            for x, w in zip(xs[:2], weights[:2]):
                a = quantize(x, col_major_scales=True)
                want = gemm_small_m(a.codes, a.scales, w.codes, w.scales)
                assert torch.equal(bits(gemm_small_m_quantizing(x, w.codes, w.scales, False)), bits(want)), (name, m)

            def separate(x, w):
                a = quantize(x, col_major_scales=True)
                return gemm_small_m(a.codes, a.scales, w.codes, w.scales)

            pre = [quantize(x, col_major_scales=True) for x in xs]
            calls = {
                "separate": [partial(separate, x, w) for x, w in zip(xs, weights)],
                "fused": [partial(gemm_small_m_quantizing, x, w.codes, w.scales, False) for x, w in zip(xs, weights)],
                "gemm_only": [partial(gemm_small_m, a.codes, a.scales, w.codes, w.scales) for a, w in zip(pre, weights)],
            }
            row = {"what": f"gemm {name}", "m": m}
            for _ in range(2):  # two rounds, in turn; the mean of each
                for key, fns in calls.items():
                    row.setdefault(key, []).append(graph_time_us(_in_turn(fns), DEV, calls=20, replays=10))
            row = {**row, **{key: statistics.mean(row[key]) for key in calls}}
            results.append(row)
            for key in calls:
                sums.setdefault(m, dict.fromkeys(calls, 0.0))[key] += row[key]
            print(f"{name:8s} M={m:3d} separate {row['separate']:6.1f}  fused {row['fused']:6.1f}  "
                  f"gemm only {row['gemm_only']:6.1f} us", flush=True)
        del weights
        free_device_memory()
    for m, s in sums.items():
        results.append({"what": "gemm sum of 4", "m": m, **s})
        print(f"sum of 4 M={m:3d}: separate {s['separate']:.1f}, fused {s['fused']:.1f}, "
              f"gemm only {s['gemm_only']:.1f} us", flush=True)


def steps(cfg, results):
    model = random_model(cfg.model_config(cfg.layers), DEV, torch.bfloat16).requires_grad_(False)
    for batch in (64, 16):
        lengths = spread_lengths(batch, cfg.decode_context)
        for recipe in ("jet", "jet_kv"):
            set_recipe(model, recipe)
            engines, logits = {}, {}
            with torch.no_grad(), precision_phase("rollout"):
                for fused in (False, True):
                    torch.manual_seed(0)
                    off = mock.patch.object(gemm_module, "_quantizes_in_gemm", return_value=False)
                    with contextlib.nullcontext() if fused else off:  # the graphs are captured under this choice
                        engines[fused] = _decode_state(model, batch, lengths, DEV)
                        logits[fused] = engines[fused].graphs(batch)[:batch].clone()
                same = torch.equal(logits[False], logits[True])
                times = {False: [], True: []}
                for fused in (False, True, False, True):
                    times[fused].append(time_ms(partial(engines[fused].graphs, batch), DEV, iters=20, warmup=2))
            off, on = statistics.mean(times[False]), statistics.mean(times[True])
            results.append({"what": f"decode step {recipe}", "batch": batch, "separate_ms": off, "fused_ms": on,
                            "logits_bit_equal": same})
            print(f"decode step {recipe:7s} B={batch:3d}: separate {off:.3f} ms, fused {on:.3f} ms "
                  f"({off / on:.3f}x); logits bit-equal {same}", flush=True)
            engines = None
            free_device_memory()


def main() -> None:
    cfg = h200_config()
    results: list[dict] = []
    gemms(cfg, results)
    steps(cfg, results)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "time_gemm_quant.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
