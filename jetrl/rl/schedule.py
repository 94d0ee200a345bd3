"""The learning rate at each optimizer step: linear warmup, then constant, linear or cosine decay (TRL's names).

With base rate lr, W warmup steps and T scheduled steps (``GRPOConfig.scheduled_optimizer_steps``), optimizer
step s (0-based) uses

    s < W:   lr * (s + 1) / W                                          linear warmup
    s >= W:  lr * f(p),  p = min(1, (s - W) / (T - W))                 progress through the decay
             f = 1 ('constant': DAPO's, verl's), 1 - p ('linear': TRL's default), (1 + cos(pi p)) / 2 ('cosine')

as Hugging Face's schedulers (``get_linear_schedule_with_warmup``, ``..._cosine_...``) compute it, so a TRL config
keeps its curve. The rate is a function of the step count alone, so a resumed run continues on the same curve.
T counts full RL steps: where DAPO's dynamic sampling drops groups, a step makes fewer optimizer steps and the run
ends before the decay does.
"""

from __future__ import annotations

import math

LR_SCHEDULER_TYPES = ("constant", "linear", "cosine")


def learning_rate_at(step: int, base: float, warmup_steps: int, total_steps: int, kind: str = "constant") -> float:
    """The learning rate of optimizer step ``step`` (0-based); see the module docstring."""
    if kind not in LR_SCHEDULER_TYPES:
        raise ValueError(f"lr_scheduler_type={kind!r}; use one of {LR_SCHEDULER_TYPES}")
    if step < warmup_steps:
        return base * (step + 1) / warmup_steps
    if kind == "constant":
        return base
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if kind == "linear":
        return base * (1.0 - progress)
    return base * 0.5 * (1.0 + math.cos(math.pi * progress))
