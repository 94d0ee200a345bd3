"""Per-rank memory of replicas against sharded FP8 weights (grpo.shard_weights; jetrl/fp8/weight_shard.py).

    PYTHONPATH=. OUT=$OUT python3 bench/probe_shard_memory.py

Two gloo ranks on one GPU (NCCL refuses two ranks on one device; on a multi-GPU node the trainer uses NCCL): each
builds the same random Qwen3 (bench/shapes.py's 8B layer shapes, LAYERS of them), runs STEPS RL steps of PROMPTS x
GENERATIONS completions of COMPLETION tokens under ``jet`` as replicas, then as shards, and reports per rank what it
holds after the steps -- masters, gradients, AdamW moments, FP8 weight codes (bytes counted from the tensors) --
and the caching allocator's allocated and peak bytes. Times are not reported: gloo moves CUDA tensors through the
host. Training CUDA graphs are off in both arms (sharding turns them off, and their pools would count for the
replicas). Checks: every update applied, the ranks' whole parameters equal (``check_in_sync``), and the shards'
gathered codes equal on both ranks. Env: LAYERS (8), PROMPTS (4), GENERATIONS (4), PROMPT (64), COMPLETION (128),
STEPS (2), SMOKE=1 (bench's smoke shapes on the CPU: a check of this script).
"""

from __future__ import annotations

import json
import os
import tempfile

import torch

GiB = 1 << 30


def _env(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def _held(trainer) -> dict[str, float]:
    from jetrl.fp8 import float8_modules

    params = list(trainer.model.parameters())
    moments = [t for state in trainer.optimizer.state.values() for t in state.values()
               if torch.is_tensor(t) and t.dim() > 0]
    caches = []
    for module in float8_modules(trainer.model).values():
        for blocks in (module.weight_cache._weight, module.weight_cache._weight_t):
            if blocks is not None:
                caches += [blocks.codes, blocks.scales]
    groups = {id(m.projection_group): m.projection_group for m in float8_modules(trainer.model).values()
              if m.projection_group is not None}
    for group in groups.values():  # the members' W entries are views of the stacked buffer; W_s^T is its own
        if group._stacked_t is not None:
            caches += [group._stacked_t.codes, group._stacked_t.scales]
    unique = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in caches}

    def nbytes(ts):
        return sum(t.numel() * t.element_size() for t in ts) / GiB

    return {"masters_gib": nbytes(params), "adamw_gib": nbytes(moments), "fp8_codes_gib": sum(unique.values()) / GiB}


def _worker(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist

    from jetrl.bench.models import free_device_memory, random_model
    from jetrl.bench.shapes import h200_config, smoke_config
    from jetrl.bench.synthetic import IdTokenizer, parity_reward, random_records
    from jetrl.fp8 import float8_modules
    from jetrl.rl import GRPOConfig, GRPOTrainer
    from jetrl.rl.replicas import Replicas

    smoke = os.environ.get("SMOKE") == "1"
    device = "cpu" if smoke else "cuda:0"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    replicas = Replicas(rank, 2, device)
    layers, prompts, generations = _env("LAYERS", 8), _env("PROMPTS", 4), _env("GENERATIONS", 4)
    prompt, completion, steps = _env("PROMPT", 64), _env("COMPLETION", 128), _env("STEPS", 2)
    cfg = (smoke_config if smoke else h200_config)(layers=layers, train_layers=layers)
    model = random_model(cfg.model_config(layers), torch.device(device), torch.bfloat16)
    records = random_records(prompts, prompt, cfg.vocab, seed=2)
    rows = []
    for arm in ("replicas", "shard"):  # shard last: it replaces the model's FP8 weights by shards
        free_device_memory()
        if not smoke:
            torch.cuda.reset_peak_memory_stats()
        args = GRPOConfig(max_steps=1_000_000, learning_rate=1e-6, num_generations=generations,
                          generation_batch_size=prompts * generations, per_device_train_batch_size=4,
                          gradient_accumulation_steps=prompts * generations // 8, max_prompt_length=prompt,
                          max_completion_length=completion, shard_weights=arm == "shard",
                          train_cuda_graphs="off")  # sharding turns them off: their pools would count for replicas
        trainer = GRPOTrainer(model, [parity_reward], args, records, tokenizer=IdTokenizer(), recipe="jet",
                              accuracy_func=None, replicas=replicas)
        for _ in range(steps):
            trainer.train_step()
        replicas.check_in_sync(trainer.model, f"after {steps} {arm} steps")
        codes = [m.weight_cache._weight.codes.view(torch.uint8).sum(dtype=torch.int64).item()
                 for m in float8_modules(trainer.model).values()]
        same_codes = replicas.gather_objects(codes)
        row = {"arm": arm, "rank": rank, "layers": layers, **_held(trainer),
               "allocated_gib": torch.cuda.memory_allocated() / GiB if not smoke else None,
               "peak_gib": torch.cuda.max_memory_allocated() / GiB if not smoke else None,
               "optimizer_steps": trainer.optimizer_steps, "nonfinite_steps": trainer.nonfinite_steps,
               "codes_equal_on_ranks": same_codes[0] == same_codes[1],
               "check": "ok" if trainer.optimizer_steps > 0 and not trainer.nonfinite_steps
               and same_codes[0] == same_codes[1] else "FAIL"}
        rows.append(row)
        trainer = None
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(rows, f)
    dist.destroy_process_group()


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(_worker, args=(os.path.join(tmp, "store"), tmp), nprocs=2, join=True)
        rows = []
        for r in range(2):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                rows += json.load(f)
    for row in rows:
        print(json.dumps(row), flush=True)
    print(f"{'arm':10} {'rank':>4} {'masters':>8} {'adamw':>8} {'fp8':>8} {'alloc':>8} {'peak':>8}  check")
    for row in rows:
        fmt = [f"{row[k]:8.2f}" if row[k] is not None else f"{'-':>8}"
               for k in ("masters_gib", "adamw_gib", "fp8_codes_gib", "allocated_gib", "peak_gib")]
        print(f"{row['arm']:10} {row['rank']:>4} {' '.join(fmt)}  {row['check']}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "shard_memory.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
