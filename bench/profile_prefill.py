"""Profile of one engine prefill forward (the 4K rollout's: ``ROWS`` prompts of ``PROMPT`` tokens, default 5 x 3072,
the engine's 16384-token chunk) over 4 layers of an 8B-shaped Qwen3 under `bf16`, `jet` and `jet_kv`: GPU time by
kernel kind, and the forward's wall time. The evidence behind docs/benchmarks.md section (e)'s 4K prefill. GPU only.

    PYTHONPATH=. python3 bench/profile_prefill.py
"""

import collections
import json
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

from jetrl.bench.models import random_model, set_recipe
from jetrl.bench.shapes import h200_config
from jetrl.bench.timing import kernel_kind
from jetrl.engine import Engine
from jetrl.fp8 import precision_phase

KINDS = (  # first match wins: (kind, substrings of the kernel name)
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
    # cuBLAS names its block-scaled FP8 kernels nvjet_..._qqtst_..._Ablk128_Bvec128 (run CC)
    ("gemm fp8", ("_gemm_kernel", "gemm_small_m", "qqtst", "blk128", "e4m3", "f8f8", "blockscal", "fp8")),
    ("gemm bf16", ("gemm", "xmma", "cutlass", "nvjet", "sm90")),
    ("quant", ("quant",)),
    ("norm", ("rms", "norm")),
    ("rope", ("rope", "rotary")),
    ("swiglu", ("swiglu", "silu")),
)


def main() -> None:
    dev = torch.device("cuda")
    rows, length, layers = int(os.environ.get("ROWS", "5")), int(os.environ.get("PROMPT", "3072")), 4
    cfg = h200_config(layers=layers)
    model = random_model(cfg.model_config(layers), dev, torch.bfloat16)
    ids = torch.randint(10, cfg.vocab, (rows, length), device=dev)
    result = {}
    for recipe in ("bf16", "jet", "jet_kv"):
        set_recipe(model, recipe)
        engine = Engine(model, max_slots=rows, max_len=length + 2)
        slots = torch.arange(rows, device=dev)
        lengths = torch.full((rows,), length, device=dev)

        def forward(engine=engine, slots=slots, lengths=lengths):
            hidden = model.hidden_states(ids, kv_cache=engine.cache.prefill(slots, lengths))
            return model.logits_from_hidden(hidden[:, -1])

        with torch.no_grad(), precision_phase("rollout"):
            for _ in range(2):
                forward()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(5):
                forward()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / 5 * 1e3
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    forward()
                torch.cuda.synchronize()
        ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        names = collections.defaultdict(lambda: [0, 0.0])
        kinds = collections.defaultdict(float)
        for e in ev:
            names[e.name[:90]][0] += 1
            names[e.name[:90]][1] += e.device_time / 3
            kinds[kernel_kind(e.name, KINDS)] += e.device_time / 3 / 1e3
        busy = sum(kinds.values())
        print(f"== {recipe}: {rows} x {length} tokens, {layers} layers: wall {wall:.2f} ms, GPU busy {busy:.2f} ms, "
              f"{len(ev) / 3:.0f} kernels")
        for k, ms in sorted(kinds.items(), key=lambda kv: -kv[1]):
            print(f"   {k:10s} {ms:8.3f} ms")
        for name, (c, us) in sorted(names.items(), key=lambda kv: -kv[1][1])[:16]:
            print(f"   {us:9.1f} us {c / 3:4.0f}x  {name}")
        result[recipe] = {"wall_ms": wall, "busy_ms": busy, "kinds_ms": dict(kinds),
                          "top": {n: v for n, v in sorted(names.items(), key=lambda kv: -kv[1][1])[:24]}}
        del engine
    for recipe in ("jet", "jet_kv"):
        print(f"{recipe}: wall {result['bf16']['wall_ms'] / result[recipe]['wall_ms']:.3f}x bf16")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "profile_prefill.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
