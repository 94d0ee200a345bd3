"""What exact mode (jetrl/exact.py) costs on the H200: the decode step, the trainer's forward and a training step,
each normal vs exact in one process, on an 8-layer random Qwen3 of Qwen3-8B's shapes (``LAYERS`` to change it).

* decode step: the engine's captured step at B = 64 and 256, mean context 640 (``ab_decode_steps``: two engines
  over the same cache, timed off, on, on, off), per recipe;
* forward: the trainer's old-logprob forward (hidden states + lm_head) over 8 x 1152 tokens, no grad;
* training step: forward + backward of the hidden states over 4 x 1152 tokens (``jet``);
* where the exact time goes: GPU time by kernel kind of one ``jet`` forward, normal and exact, and of one exact
  decode step at B = 64 (``jet``, ``jet_kv``; torch.profiler; ``PROFILE=0`` skips both).

Prints one JSON line per row; writes $OUT/probe_exact_speed.json.

    PYTHONPATH=. OUT=$OUT [LAYERS=8] python3 bench/probe_exact_speed.py
"""

import dataclasses
import json
import os
from functools import partial

import torch

from jetrl.bench.models import free_device_memory, random_model, set_recipe
from jetrl.bench.rollout import ABBA, _decode_state, ab_decode_steps, spread_lengths
from jetrl.bench.shapes import h200_config
from jetrl.bench.timing import kernel_kind, time_ms
from jetrl.exact import use_exact
from jetrl.fp8.recipe import precision_phase


def _ab(fn, dev) -> dict:
    times = {False: [], True: []}
    for on in ABBA:
        with use_exact(on):
            times[on].append(time_ms(fn, dev, iters=5, warmup=1))
    normal, exact = sum(times[False]) / 2, sum(times[True]) / 2
    return {"normal_ms": normal, "exact_ms": exact, "exact_over_normal": exact / normal}


KINDS = (("exact attention", ("_exact_attention",)), ("exact linear", ("_exact_linear",)),
         ("exact fp8 gemm", ("_gemm_exact",)), ("attention", ("flash", "fmha", "attention", "cudnn")),
         ("fp8 gemm", ("gemm_small_m", "qqtst", "blk128", "_gemm_kernel", "gluon")),
         ("bf16 gemm", ("gemm", "xmma", "cutlass", "nvjet", "sm90")), ("quant", ("quant",)))


def _profile(fn) -> dict:
    """GPU ms by kernel kind of one call of ``fn`` (warm)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    by_kind: dict[str, float] = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" and e.self_device_time_total > 0:
            kind = kernel_kind(e.key, KINDS)
            by_kind[kind] = by_kind.get(kind, 0.0) + e.self_device_time_total / 1e3
    return {k: round(v, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])}


def main() -> None:
    dev, layers = torch.device("cuda"), int(os.environ.get("LAYERS", "8"))
    cfg = dataclasses.replace(h200_config(), layers=layers)
    model = random_model(cfg.model_config(layers), dev, torch.bfloat16).requires_grad_(False)
    rows = []
    for r in ab_decode_steps(model, cfg, use_exact, [64, 256], dev):
        a, b = r["logits"][False], r["logits"][True]
        rows.append({"what": "decode step", "recipe": r["recipe"], "batch": r["batch"], "layers": layers,
                     "normal_ms": r["off_ms"], "exact_ms": r["on_ms"], "exact_over_normal": r["on_ms"] / r["off_ms"],
                     "logits_rel_diff": float((a - b).norm() / a.norm())})
        print(json.dumps(rows[-1]), flush=True)
    if os.environ.get("PROFILE", "1") == "1":  # where the exact decode step's time goes (kernels of the graph replay)
        for recipe in ("jet", "jet_kv"):
            set_recipe(model, recipe)
            with torch.no_grad(), precision_phase("rollout"), use_exact():
                engine = _decode_state(model, 64, spread_lengths(64, cfg.decode_context), dev)
                rows.append({"what": "exact decode step B = 64, GPU ms by kernel kind", "recipe": recipe,
                             "layers": layers, **_profile(partial(engine.graphs, 64))})
            print(json.dumps(rows[-1]), flush=True)
            engine = None
            free_device_memory()
    g = torch.Generator(device=dev).manual_seed(0)
    ids = torch.randint(0, cfg.model_config(1).vocab_size, (8, 1152), device=dev, generator=g)
    for recipe in ("bf16", "jet", "jet_kv"):
        set_recipe(model, recipe)

        def forward():
            with torch.no_grad():
                return model.logits_from_hidden(model.hidden_states(ids))

        rows.append({"what": "trainer forward 8 x 1152", "recipe": recipe, "layers": layers, **_ab(forward, dev)})
        print(json.dumps(rows[-1]), flush=True)
        if recipe == "jet" and os.environ.get("PROFILE", "1") == "1":
            for on in (False, True):
                with use_exact(on):
                    rows.append({"what": "trainer forward 8 x 1152, GPU ms by kernel kind", "recipe": recipe,
                                 "exact": on, "layers": layers, **_profile(forward)})
                print(json.dumps(rows[-1]), flush=True)
        free_device_memory()
    set_recipe(model, "jet")
    model.requires_grad_(True)

    def train_step():
        model.hidden_states(ids[:4]).float().square().mean().backward()

    rows.append({"what": "fwd+bwd 4 x 1152 (hidden states)", "recipe": "jet", "layers": layers, **_ab(train_step, dev)})
    print(json.dumps(rows[-1]), flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "probe_exact_speed.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
