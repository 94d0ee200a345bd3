"""Profile of the training phase's update (fwd + bwd + AdamW over 2 micro-batches of 8 x 1152 tokens) on
the 8B-shaped model of ``jetrl bench`` section (f) (``LAYERS`` of its 36, default all) or a smaller Qwen3's shapes
(``SIZE=0.6b``, ``1.7b`` or ``4b``), under `bf16` and `jet` (``RECIPES``), eager or with the decoder layers replayed
from CUDA graphs (``GRAPHS=on``): GPU time per kernel and per kind of kernel, the GPU's idle time in the update's
span and its longest gaps (the kernels on either side), the host's time by operator, and the allocator's retries.
The evidence behind docs/benchmarks.md section (f). GPU only.

    PYTHONPATH=. python3 bench/profile_training.py
    SIZE=0.6b GRAPHS=on PYTHONPATH=. python3 bench/profile_training.py
"""

import collections
import os
import re
from dataclasses import replace

import torch
from torch.profiler import ProfilerActivity, profile

from jetrl.bench.models import free_device_memory, random_model
from jetrl.bench.shapes import QWEN3_SHAPES, h200_config, smoke_config
from jetrl.bench.synthetic import random_batch, random_records
from jetrl.bench.training import _trainer

KINDS = [  # (kind, pattern on the kernel name), first match wins
    ("fp8 gemm (cuBLAS block)", r"(?i)(sm90_xmma_gemm.*e4m3|cutlass.*e4m3|blockwise|f8f8|e4m3.*gemm|gemm.*e4m3)"),
    ("quantize (jetrl triton)", r"_quantize"),
    ("bf16 gemm", r"(?i)(gemm|xmma|cutlass|nvjet)"),
    ("attention", r"(?i)(flash|fmha|attention|sdpa)"),
    ("adamw / foreach", r"(?i)(multi_tensor|foreach|adam)"),
    ("fused norm/rope/swiglu (triton)", r"(_rms|_rope|_silu|_swiglu)"),
    ("softmax / logprob", r"(?i)(softmax|log_softmax|logsumexp|cross_entropy|nll)"),
    ("reduce", r"(?i)reduce"),
    ("copy / cast", r"(?i)(copy|cast|convert|to_copy|cat)"),
    ("elementwise", r"(?i)elementwise|vectorized"),
]


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name):
            return kind
    return "other"


def _idle_gaps(events: list) -> list[tuple[float, str, str]]:
    """The GPU's idle stretches over 20 us between consecutive kernels, longest first: (us, kernel before, after)."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in events)
    gaps, end, name = [], spans[0][1], spans[0][2]
    for start, stop, nxt in spans[1:]:
        if start - end > 20:
            gaps.append((start - end, name, nxt))
        if stop > end:
            end, name = stop, nxt
    return sorted(gaps, reverse=True)


def main() -> None:
    smoke = not torch.cuda.is_available()  # CPU: the smoke shapes, CPU events (checks the script runs)
    cfg = smoke_config() if smoke else h200_config(train_layers=int(os.environ.get("LAYERS", "36")))
    if not smoke and os.environ.get("SIZE"):
        cfg = replace(cfg, **QWEN3_SHAPES[os.environ["SIZE"]])
    cfg = replace(cfg, train_cuda_graphs=os.environ.get("GRAPHS", "off"))
    dev = torch.device("cpu" if smoke else "cuda")
    kind = torch.autograd.DeviceType.CPU if smoke else torch.autograd.DeviceType.CUDA
    model = random_model(cfg.model_config(cfg.train_layers), dev, torch.bfloat16)
    batch = random_batch(cfg.train_batch, cfg.train_prompt, cfg.train_completion, cfg.vocab)
    records = random_records(cfg.train_batch, cfg.train_prompt, cfg.vocab)
    for recipe in os.environ.get("RECIPES", "bf16,jet").split(","):
        trainer = _trainer(model, recipe, records, generations=2, batch=cfg.train_batch, prompt_len=cfg.train_prompt,
                           completion_len=cfg.train_completion, cfg=cfg)
        metrics = {}
        trainer._old_logprobs(batch, metrics)  # sets the batch's old logprobs
        trainer._update(batch, metrics)  # warm-up
        torch.cuda.synchronize() if not smoke else None
        retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) if not smoke else 0
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            trainer._update(batch, metrics)
            torch.cuda.synchronize() if not smoke else None
        ev = [e for e in prof.events() if e.device_type == kind]
        if not ev:
            print(f"== {recipe}: no kernel events recorded")
            continue
        by_name, by_kind = collections.defaultdict(lambda: [0, 0.0]), collections.defaultdict(lambda: [0, 0.0])
        for e in ev:
            for table, key in ((by_name, e.name[:90]), (by_kind, kind_of(e.name))):
                table[key][0] += 1
                table[key][1] += (e.self_cpu_time_total if smoke else e.device_time) / 1e3
        busy = sum(v[1] for v in by_kind.values())
        span = (max(e.time_range.end for e in ev) - min(e.time_range.start for e in ev)) / 1e3
        retries = (torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries) if not smoke else 0
        peak = torch.cuda.max_memory_allocated() / 2**30 if not smoke else 0.0
        print(f"== {recipe}: {len(ev)} kernels, GPU busy {busy:.1f} ms of a {span:.1f} ms span; "
              f"allocator retries {retries}, peak {peak:.1f} GiB")
        for kind, (c, ms) in sorted(by_kind.items(), key=lambda kv: -kv[1][1]):
            print(f"   {ms:8.1f} ms {c:6d}x  {kind}")
        for name, (c, ms) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:25]:
            print(f"      {ms:8.2f} ms {c:5d}x  {name}")
        gaps = _idle_gaps(ev)
        idle_ms = sum(g for g, *_ in gaps) / 1e3
        print(f"   idle gaps over 20 us: {len(gaps)}, {idle_ms:.1f} ms; the longest, after -> before:")
        for gap, before, after in gaps[:12]:
            print(f"      {gap / 1e3:8.2f} ms  {before[:60]} -> {after[:60]}")
        host = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:15]
        print("   by host time (self CPU, ms):", ", ".join(f"{a.key} {a.self_cpu_time_total / 1e3:.1f} ({a.count}x)"
                                                         for a in host))
        ops = [a for a in prof.key_averages() if a.key.startswith("aten::") or a.key.startswith("autograd")]
        print("   by operator (GPU time of its kernels, self):")
        for a in sorted(ops, key=lambda a: -a.self_device_time_total)[:25]:
            print(f"      {a.self_device_time_total / 1e3:8.2f} ms {a.count:5d}x  {a.key}")
        trainer = None
        free_device_memory()


if __name__ == "__main__":
    main()
