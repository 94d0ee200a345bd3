"""Bench (e)'s rollout at smaller Qwen3 shapes: does the FP8 engine's gain survive where a decode step is short?

Section (e) measures the 8B. GRPO on 0.6-4B models is common, and there a decode step's GPU work shrinks with the
model while the engine's host work per step does not, so a host-bound step would hide what FP8 saves. This runs
(e)'s own code (``jetrl.bench.rollout.engine_rollout``: one ``Engine.generate`` of B random prompts, 128 prompt + N
new tokens, after a warm-up) for ``bf16``, ``jet`` and ``jet_kv`` at the layer shapes of ``SIZES`` (Qwen3 0.6B /
1.7B / 4B, the 8B's vocabulary and an untied lm_head) and batches ``BATCHES``, and prints each step against its
bytes floor and each FP8 recipe against ``bf16`` next to the floor ratio.

    SIZES=0.6b,1.7b BATCHES=64,256 NEW=512 PYTHONPATH=. OUT=$OUT python3 bench/probe_small_rollout.py
"""

import json
import os
from dataclasses import replace

import torch

from jetrl.bench.models import free_device_memory, random_model
from jetrl.bench.rollout import engine_rollout
from jetrl.bench.shapes import QWEN3_SHAPES, h200_config
from jetrl.bench.synthetic import random_prompts


def main() -> None:
    device = torch.device("cuda")
    new = int(os.environ.get("NEW", "512"))
    results = {}
    for size in os.environ.get("SIZES", "0.6b,1.7b").split(","):
        cfg = replace(h200_config(), **QWEN3_SHAPES[size])  # train_layers: the size's layer count
        model = random_model(cfg.model_config(cfg.train_layers), device, torch.bfloat16).requires_grad_(False)
        for batch in [int(b) for b in os.environ.get("BATCHES", "64,256").split(",")]:
            prompts = random_prompts(batch, 128, cfg.vocab, seed=0)
            runs = {}
            for recipe in ("bf16", "jet", "jet_kv"):
                runs[recipe] = engine_rollout(model, recipe, prompts, new, device)
                free_device_memory()
            base = runs["bf16"]
            for recipe, r in runs.items():
                line = {"size": size, "batch": batch, "recipe": recipe, "tok_s": round(r["tok_s"]),
                        "ms_per_step": round(r["ms_per_step"], 3), "x_floor": round(r["ms_per_step"] /
                                                                                     r["floor_ms_per_step"], 2),
                        "vs_bf16": round(r["tok_s"] / base["tok_s"], 3),
                        "step_vs_bf16": round(base["ms_per_step"] / r["ms_per_step"], 3),
                        "floor_ratio": round(base["floor_ms_per_step"] / r["floor_ms_per_step"], 3), "ok": r["ok"]}
                results[f"{size} B={batch} {recipe}"] = {**r, **line}
                print(json.dumps(line), flush=True)
        del model
        free_device_memory()
    with open(os.path.join(os.environ.get("OUT", "."), "probe_small_rollout.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
