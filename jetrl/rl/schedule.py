"""The learning rate at each optimizer step: linear warmup, then constant, linear or cosine decay (TRL's names).

With base rate lr, W warmup steps and T = max_steps x K scheduled steps (K: the optimizer steps of a full RL step,
``GRPOConfig.rl_step_optimizer_steps``), the optimizer step at position s uses

    s < W:   lr * (s + 1) / W                                          linear warmup
    s >= W:  lr * f(p),  p = min(1, (s - W) / (T - W))                 progress through the decay
             f = 1 ('constant': DAPO's, verl's), 1 - p ('linear': TRL's default), (1 + cos(pi p)) / 2 ('cosine')

as Hugging Face's schedulers (``get_linear_schedule_with_warmup``, ``..._cosine_...``) compute it, so a TRL config
keeps its curve. The position counts the run's progress, not the steps taken: the j-th of the k optimizer steps of
RL step r (0-based) sits at s = (r + j / k) K, which is the plain step count where every RL step makes its K steps.
So a step that makes fewer (DAPO's dynamic sampling dropped groups) or skips one (a non-finite gradient) leaves the
next RL step on schedule, the last steps of a run decay to about 0, and a run resumed on another number of
data-parallel ranks (another K) continues at the same fraction of the run.
"""

from __future__ import annotations

import math

LR_SCHEDULER_TYPES = ("constant", "linear", "cosine")


def learning_rate_at(step: float, base: float, warmup_steps: int, total_steps: int, kind: str = "constant") -> float:
    """The learning rate of the optimizer step at position ``step`` (0-based) of ``total_steps``; see the module
    docstring."""
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
