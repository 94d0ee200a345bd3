"""What ``jetrl train`` runs until the GRPO trainer lands: the FP8 precision flow on a toy fit.

A student MLP learns a random teacher MLP (regression, AdamW) under a precision recipe,
next to a BF16 twin with the same seed. Each step it also runs the "rollout" forward (the
engine's phase) on held-out inputs and compares it with the training forward:

    rollout_abs_diff = mean |f_rollout(x) - f_train(x)|

Under ``bf16`` and ``jet`` the rollout is the training forward's graph, so the difference
is exactly 0; under ``fp8_rollout`` (BF16 training, FP8 rollout) it is not: that gap is the
off-policy error Jet-RL removes. The last stdout line is one JSON object.
"""

from __future__ import annotations

import json
import time

import torch
import torch.nn as nn

from jetrl.fp8 import check_rollout_subgraph, convert_to_float8, get_recipe, precision_phase, refresh_weight_caches


def _mlp(dim: int, hidden: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, dim))


def run_demo(recipe_name: str = "jet", steps: int = 150, dim: int = 256, hidden: int = 512, batch: int = 256,
             lr: float = 2e-3, seed: int = 0) -> dict:
    start = time.time()
    recipe = get_recipe(recipe_name)
    report = check_rollout_subgraph(recipe)  # raises for an undeclared off-policy recipe
    teacher = _mlp(dim, hidden, seed + 1).requires_grad_(False)
    students = {"bf16": _mlp(dim, hidden, seed), recipe_name: convert_to_float8(_mlp(dim, hidden, seed), recipe)}
    optims = {k: torch.optim.AdamW(m.parameters(), lr=lr) for k, m in students.items()}
    gen = torch.Generator().manual_seed(seed)
    x_eval = torch.randn(batch, dim, generator=gen)
    history = []
    for step in range(1, steps + 1):
        x = torch.randn(batch, dim, generator=gen)
        target = teacher(x)
        row = {"step": step}
        for key, model in students.items():
            loss = nn.functional.mse_loss(model(x), target)
            optims[key].zero_grad(set_to_none=True)
            loss.backward()
            optims[key].step()
            refresh_weight_caches(model)
            row[f"loss/{key}"] = loss.item()
        model = students[recipe_name]
        with torch.no_grad():
            y_train = model(x_eval)
            with precision_phase("rollout"):
                y_rollout = model(x_eval)
        row["rollout_abs_diff"] = (y_rollout - y_train).abs().mean().item()
        history.append(row)
        if step == 1 or step % max(1, steps // 5) == 0 or step == steps:
            print(f"step {step:4d}  loss[{recipe_name}] {row[f'loss/{recipe_name}']:.5f}  "
                  f"loss[bf16] {row['loss/bf16']:.5f}  rollout-vs-train |diff| {row['rollout_abs_diff']:.2e}")
    last = history[-1]
    return {
        "job": "fp8-core demo (teacher-student regression); the GRPO trainer replaces it",
        "recipe": recipe_name,
        "on_policy": report["on_policy"],
        "steps": steps,
        "final_loss": last[f"loss/{recipe_name}"],
        "final_loss_bf16": last["loss/bf16"],
        "rollout_abs_diff_mean": sum(r["rollout_abs_diff"] for r in history) / len(history),
        "wall_s": round(time.time() - start, 2),
    }


def main(recipe: str = "jet", steps: int = 150, seed: int = 0) -> int:
    result = run_demo(recipe, steps=steps, seed=seed)
    print(json.dumps(result))
    return 0
