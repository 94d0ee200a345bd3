"""Device memory each of (g)'s configurations leaves behind, on one model (a question for the H200).

Run BI's (g) ran ``bf16`` again after ``jet`` / ``jet_kv`` (a drift check, not kept) and that run ran out of memory
in its update: ~6.5 GiB more was allocated than in the first ``bf16`` run's peak. Here (g)'s configurations, then
``bf16`` again, each run one RL step on the same model, as in (g); after each trainer is freed, and again after the
model is converted back to plain BF16, the script prints what is still allocated, how much of it Python can still
reach (CUDA tensors found by the garbage collector), and the largest of those by dtype and shape (run BJ,
docs/benchmarks.md (g)).

    LAYERS=8 PYTHONPATH=. OUT=$OUT python3 bench/probe_memory.py
"""

import collections
import gc
import json
import os

import torch

from jetrl.bench import training
from jetrl.bench.models import free_device_memory, random_model, strip_precision
from jetrl.bench.shapes import h200_config
from jetrl.bench.synthetic import random_records

GIB = 2**30


def census() -> dict:
    gc.collect()
    torch.cuda.synchronize()
    seen, by_kind, reachable = set(), collections.Counter(), 0
    for obj in gc.get_objects():
        if torch.is_tensor(obj) and obj.is_cuda:
            storage = obj.untyped_storage()
            if storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            reachable += storage.nbytes()
            by_kind[f"{obj.dtype} {tuple(obj.shape)}"] += storage.nbytes()
    return {"allocated_gib": torch.cuda.memory_allocated() / GIB, "reachable_gib": reachable / GIB,
            "largest": [(k, round(v / GIB, 3)) for k, v in by_kind.most_common(6)]}


def main() -> None:
    device = torch.device("cuda")
    cfg = h200_config(train_layers=int(os.environ.get("LAYERS", "8")))
    model = random_model(cfg.model_config(cfg.train_layers), device, torch.bfloat16)
    records = random_records(cfg.rl_prompts, cfg.rl_prompt, cfg.vocab, seed=2)
    num = cfg.rl_prompts * cfg.rl_generations
    rows = [{"after": "model built", **census()}]
    for recipe, old_logprobs in (*training.RL_STEP_CONFIGS, ("bf16", "recompute")):
        trainer = training._trainer(model, recipe, records, generations=cfg.rl_generations, batch=num,
                                    prompt_len=cfg.rl_prompt, completion_len=cfg.rl_completion, cfg=cfg,
                                    old_logprobs=old_logprobs)
        trainer.train_step()
        del trainer
        free_device_memory()
        rows.append({"after": f"{recipe} {old_logprobs}: trainer freed", **census()})
        strip_precision(model)
        free_device_memory()
        rows.append({"after": f"{recipe} {old_logprobs}: model stripped", **census()})
        print(rows[-2], rows[-1], sep="\n", flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "probe_memory.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"\n{'after':42} {'allocated GiB':>14} {'reachable GiB':>14}")
    for r in rows:
        print(f"{r['after']:42} {r['allocated_gib']:14.2f} {r['reachable_gib']:14.2f}")


if __name__ == "__main__":
    main()
