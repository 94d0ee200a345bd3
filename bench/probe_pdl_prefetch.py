"""Programmatic dependent launch with the weight loaded *before* the dependency wait (jetrl/fp8/kernels/pdl.py), on
and off in one process, on the H200.

Run AT's PDL (commit cc27cb3) put ``griddepcontrol.wait`` first in every kernel, so a kernel started early could
overlap nothing but its launch, and the small-M GEMMs got slower. A decode GEMM's weight, though, is written by no
kernel in flight, so the Gluon GEMM fills its shared-memory ring with the weight's first groups while the kernel
before it -- which writes its input and releases it early -- still runs; only the activation loads wait.

1. One 8B layer's decode GEMMs as a Float8Linear forward runs them, each after its input's quantization (quantize
   -> qkv -> quantize -> o -> quantize -> gate_up -> quantize -> down), over weight copies that do not fit L2,
   under CUDA-graph replay, at M = 48-256, all four on the Gluon kernel (bench (c)'s ``fp8`` column takes cuBLAS for
   qkv and gate_up at M = 256).
2. The engine's decode step (8B-shaped random Qwen3, 36 layers, mean context 640) for ``bf16``, ``jet`` and
   ``jet_kv`` at B = 64 (the RL step's rollout) and 256 (bench (d)), as the library runs it: PDL-launched GEMMs and
   releasing producers up to ``PDL_MAX_M`` rows (at B = 256, by default, the two arms run the same launches).

Each configuration is timed off, on, on, off (the mean of each pair kept; runs BQ-BT timed off, on, off, on, and
their two B = 256 arms differed by 0.6-2.6% even where they ran the same code, run BT: a drift against the arm timed
second, or the two engines' placement), and the PDL outputs (GEMMs, the step's logits) are checked bit for bit
against the plain launch's. GPU only; writes $OUT/probe_pdl_prefetch.json.

    PYTHONPATH=. OUT=$OUT python3 bench/probe_pdl_prefetch.py

``SECTIONS=steps`` skips the GEMMs, ``STEP_BATCHES=256`` picks the batches, ``ON_FIRST=1`` builds the PDL engine
first (the two engines coexist, so their build order is a bias to rule out), ``PDL_MAX_M=256`` PDL-launches the
GEMMs (and releases their producers) up to that many rows in the "on" arm -- the question left open at B = 256.

Run BP measured the first form of this probe (section 1 only, with more variants: the input's quantization
PDL-launched itself, waiting before or after its release, and the GEMM asking L2 for 8-32 more groups of its weight
with ``cp.async.bulk.prefetch.L2`` before its wait): the shared-memory ring alone won (docs/benchmarks.md (c)).
"""

import json
import os
import statistics
from functools import partial

import torch
import torch.nn.functional as F

from jetrl.bench.models import free_device_memory, random_model
from jetrl.bench.rollout import ABBA, ab_decode_steps
from jetrl.bench.shapes import h200_config
from jetrl.bench.timing import graph_time_us
from jetrl.fp8.gemm import gluon_tiles
from jetrl.fp8.kernels import pdl
from jetrl.fp8.kernels.gemm_gluon import gemm_mid_m
from jetrl.fp8.kernels.pdl import use_pdl
from jetrl.fp8.kernels.quant_triton import quantize_triton
from jetrl.fp8.quant import quantize

DEV = torch.device("cuda")


def ab(measure) -> tuple[float, float]:
    """(off, on): each the mean of two measurements, taken off, on, on, off."""
    times = {False: [], True: []}
    for on in ABBA:
        with use_pdl(on):
            times[on].append(measure())
    return statistics.mean(times[False]), statistics.mean(times[True])


def rotate(fn, items):
    """One callable that runs ``fn`` on items[1], items[2], ... in turn (each captured call hits another copy)."""
    state = {"i": 0}

    def run():
        state["i"] += 1
        return fn(items[state["i"] % len(items)])
    return run


def layer_chain(layer, xs, cfgs):
    """The four GEMMs of one layer, each after its input's quantization (the launches a Float8Linear makes), as the
    library launches them: PDL where ``use_pdl`` allows it, up to ``pdl.PDL_MAX_M`` rows (``PDL_MAX_M`` above)."""
    for (wq, cfg), x in zip(zip(layer, cfgs), xs):
        codes, scales = quantize_triton(x, 1, 128, False)
        gemm_mid_m(codes, scales, wq.codes, wq.scales, config=cfg)


def gemms(cfg, results):
    gemm_shapes = list(cfg.layer_gemms())  # (name, k, n)
    torch.manual_seed(0)
    copies = max(2, -(-150_000_000 // sum(n * k for _, k, n in gemm_shapes)))
    weights = [[torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02 for _, k, n in gemm_shapes]
               for _ in range(copies)]
    fp8 = [[quantize(w, (128, 128)) for w in layer] for layer in weights]
    for m in (48, 64, 128, 256):
        xs = [torch.randn(m, k, device=DEV, dtype=torch.bfloat16) for _, k, _ in gemm_shapes]
        cfgs = [gluon_tiles(m, n, k) for _, k, n in gemm_shapes]
        for (name, _, _), x, wq, c in zip(gemm_shapes, xs, fp8[0], cfgs):
            outs = {}
            for on in (False, True):
                with use_pdl(on):
                    codes, scales = quantize_triton(x, 1, 128, False)
                    outs[on] = gemm_mid_m(codes, scales, wq.codes, wq.scales, config=c, pdl=on)
            assert torch.equal(outs[False], outs[True]), f"{name} M={m}: PDL changed the GEMM's output"

        def bf16_layer(layer, xs=xs):
            for w, x in zip(layer, xs):
                F.linear(x, w)

        bf16 = graph_time_us(rotate(bf16_layer, weights), DEV, calls=12, replays=10)
        chain = rotate(partial(layer_chain, xs=xs, cfgs=cfgs), fp8)
        off, on = ab(partial(graph_time_us, chain, DEV, calls=12, replays=10))
        results.append({"what": "4 GEMMs after their quantization", "m": m, "bf16_us": bf16, "off_us": off,
                        "on_us": on})
        print(f"M={m:3d}: bf16 {bf16:6.1f}, fp8 PDL off {off:6.1f} ({bf16 / off:.3f}x), on {on:6.1f} "
              f"({bf16 / on:.3f}x) us per layer", flush=True)
    weights = fp8 = None
    free_device_memory()


def steps(cfg, results):
    model = random_model(cfg.model_config(cfg.layers), DEV, torch.bfloat16).requires_grad_(False)
    batches = [int(b) for b in os.environ.get("STEP_BATCHES", "64,256").split(",")]
    build_order = (True, False) if os.environ.get("ON_FIRST") == "1" else (False, True)
    for r in ab_decode_steps(model, cfg, use_pdl, batches, DEV, build_order):
        logits, recipe, batch, off, on = r.pop("logits"), r["recipe"], r["batch"], r["off_ms"], r["on_ms"]
        same = torch.equal(logits[False], logits[True])
        results.append({**r, "what": f"decode step {recipe}", "logits_bit_equal": same})
        print(f"decode step {recipe:7s} B={batch:3d}: PDL off {off:.3f} ms, on {on:.3f} ms "
              f"({off / on:.3f}x); logits bit-equal {same}", flush=True)
        assert same, f"{recipe} B={batch}: PDL changed the decode step's logits"
    del model
    free_device_memory()


def main() -> None:
    if os.environ.get("PDL_MAX_M"):
        pdl.PDL_MAX_M = int(os.environ["PDL_MAX_M"])  # read at every launch (gemm_gluon.py, pdl.release_rows)
    cfg = h200_config()
    results: list[dict] = []
    try:
        if os.environ.get("SECTIONS", "gemms,steps") != "steps":
            gemms(cfg, results)
        steps(cfg, results)
    finally:
        with open(os.path.join(os.environ.get("OUT", "/tmp"), "probe_pdl_prefetch.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
