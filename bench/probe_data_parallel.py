"""Data-parallel RL steps (jetrl/rl/replicas.py): the 8B-shaped step of bench (g) on 1 GPU and on N under torchrun.

    PYTHONPATH=. OUT=$OUT python3 bench/probe_data_parallel.py                         # one process, one GPU
    PYTHONPATH=. OUT=$OUT torchrun --nproc_per_node 2 bench/probe_data_parallel.py     # two replicas

Each rank builds the same random Qwen3 (bench/shapes.py's 8B shapes, LAYERS of them) and a GRPOTrainer over
``PROMPTS`` prompts per step (the whole step's; each rank samples its block) x ``GENERATIONS`` samples of
``COMPLETION`` tokens after ``PROMPT``-token prompts, micro-batches of ``MICRO``. After one warm-up step (graph
capture), ``STEPS`` steps are timed on every rank; a step's time is the slowest rank's. Checks: the replicas'
weights are equal after the steps (``check_in_sync``), every completion is full length, every update applied.
Rank 0 prints one JSON line per recipe and writes them to ``$OUT/data_parallel_<world>.json``.
Env: RECIPES (default ``bf16,jet``), PROMPTS (8), GENERATIONS (8), PROMPT (128), COMPLETION (1024), LAYERS (36),
MICRO (8), STEPS (2), SHARD=1 (``grpo.shard_optimizer_state``: ZeRO-1); SMOKE=1 takes the bench's smoke shapes
(a CPU check of this script: SMOKE=1 COMPLETION=8 PROMPT=8 LAYERS=2 MICRO=4 torchrun --nproc_per_node 2
bench/probe_data_parallel.py).
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch

from jetrl.bench.models import free_device_memory, random_model, strip_precision
from jetrl.bench.shapes import h200_config, smoke_config
from jetrl.bench.synthetic import IdTokenizer, parity_reward, random_records
from jetrl.rl import GRPOConfig, GRPOTrainer
from jetrl.rl.replicas import close_replicas, init_replicas


def _env(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def main() -> None:
    replicas, device = init_replicas("cuda" if torch.cuda.is_available() else "cpu")
    prompts, generations, micro = _env("PROMPTS", 8), _env("GENERATIONS", 8), _env("MICRO", 8)
    prompt, completion = _env("PROMPT", 128), _env("COMPLETION", 1024)
    layers, steps = _env("LAYERS", 36), _env("STEPS", 2)
    smoke = os.environ.get("SMOKE") == "1"  # smoke_config's small shapes: a CPU check of the script itself
    cfg = (smoke_config if smoke else h200_config)(layers=layers, train_layers=layers, micro_batch=micro)
    model = random_model(cfg.model_config(layers), torch.device(device), torch.bfloat16)
    replicas.check_in_sync(model, "after building the random model")
    records = random_records(prompts, prompt, cfg.vocab, seed=2)
    local = prompts * generations // replicas.world_size
    out = []
    for recipe in os.environ.get("RECIPES", "bf16,jet").split(","):
        args = GRPOConfig(max_steps=1_000_000, learning_rate=1e-6, num_generations=generations,
                          generation_batch_size=prompts * generations, per_device_train_batch_size=micro,
                          gradient_accumulation_steps=max(local // micro, 1), max_prompt_length=prompt,
                          max_completion_length=completion, temperature=1.0,
                          shard_optimizer_state=os.environ.get("SHARD") == "1")
        strip_precision(model)
        trainer = GRPOTrainer(model, [parity_reward], args, records, tokenizer=IdTokenizer(), recipe=recipe,
                              accuracy_func=None, replicas=replicas)
        times, lengths, phases = [], [], {}
        for i in range(1 + steps):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            metrics = trainer.train_step()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            seconds = replicas.max([time.perf_counter() - t0])[0]
            if i:
                times.append(seconds)
                lengths.append(metrics["completions/mean_length"])
                phases = {k: metrics[k] for k in ("time/rollout", "time/old_logprobs", "time/update")}
        replicas.check_in_sync(trainer.model, f"after {1 + steps} {recipe} steps")
        step_s = statistics.median(times)
        row = {"recipe": recipe, "world_size": replicas.world_size, "completions_per_step": prompts * generations,
               "per_rank": local, "shape": f"{prompt}+{completion}", "layers": layers, "step_s": step_s,
               "completions_per_s": prompts * generations / step_s, "phases_s": phases,
               "optimizer_steps": trainer.optimizer_steps, "nonfinite_steps": trainer.nonfinite_steps,
               "shard_optimizer_state": args.shard_optimizer_state,
               "check": "ok" if all(n == completion for n in lengths) and not trainer.nonfinite_steps else
               f"FAIL mean lengths {lengths}, {trainer.nonfinite_steps} non-finite steps",
               "replicas_in_sync": True, "torch": torch.__version__,
               "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"}
        out.append(row)
        if replicas.is_main:
            print(json.dumps(row), flush=True)
        trainer = None
        free_device_memory()
    if replicas.is_main and os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"data_parallel_{replicas.world_size}.json"), "w") as f:
            json.dump(out, f, indent=1)
    close_replicas(replicas)


if __name__ == "__main__":
    main()
