"""Group-relative advantages (GRPO): each completion is scored against its own group.

For a prompt sampled G times with rewards r_1..r_G (one group),

    A_i = r_i - mean(r)                         scale_rewards = "none"   (Dr. GRPO)
    A_i = (r_i - mean(r)) / (std(r) + eps)      scale_rewards = "group"  (GRPO, TRL's default)
    A_i = (r_i - mean(r)) / (std_batch + eps)   scale_rewards = "batch"  (std over the whole batch)

with the unbiased std, as TRL computes it. A group whose rewards are all equal carries no
signal: its advantages are exactly 0, and with DAPO's dynamic sampling it is dropped
(:func:`zero_signal_groups` finds them). Every completion token of a sequence gets that
sequence's advantage.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

ScaleRewards = Literal["group", "batch", "none"]


def group_advantages(rewards: Tensor, num_generations: int, scale_rewards: ScaleRewards = "group",
                     eps: float = 1e-4, batch_rewards: Tensor | None = None) -> Tensor:
    """rewards (num_prompts * G,), grouped contiguously -> advantages of the same shape (fp32). ``batch_rewards``:
    the whole batch's rewards for ``scale_rewards='batch'`` when ``rewards`` is one data-parallel rank's share
    (default: ``rewards`` itself)."""
    if rewards.dim() != 1 or num_generations < 1 or rewards.numel() % num_generations:
        raise ValueError(
            f"rewards must be 1-D with a multiple of num_generations={num_generations} entries, "
            f"got shape {tuple(rewards.shape)}"
        )
    grouped = rewards.float().view(-1, num_generations)  # (P, G)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_rewards == "none":
        return centered.flatten()
    if num_generations == 1:
        raise ValueError("scale_rewards needs num_generations >= 2 (a std of one sample is undefined)")
    if scale_rewards == "group":
        std = grouped.std(dim=1, keepdim=True)
    elif scale_rewards == "batch":
        whole = rewards if batch_rewards is None else batch_rewards
        std = whole.float().std().expand_as(grouped[:, :1])
    else:
        raise ValueError(f"scale_rewards={scale_rewards!r}; use 'group', 'batch' or 'none'")
    # a zero-signal group stays exactly 0 even with eps = 0 (no 0/0)
    return torch.where(centered == 0, 0.0, centered / (std + eps)).flatten()


def zero_signal_groups(rewards: Tensor, num_generations: int) -> Tensor:
    """(num_prompts,) bool: groups whose rewards are all equal (DAPO dynamic sampling drops them)."""
    grouped = rewards.view(-1, num_generations)
    return (grouped == grouped[:, :1]).all(dim=1)
