"""Trainer-side logprobs of given completions: the reference every rollout logprob is compared with.

The policy-gradient ratio and every mismatch metric of design.md §6 compare the logprob the
rollout engine reported for a sampled token with the one the trainer computes for the same
token: one full causal forward over prompt + completion in the *train* precision phase (the
default: no ``precision_phase`` context here), at temperature 1 unless asked,

    lp_t[j] = log_softmax(logits[P - 1 + j] / T)[c_j],    j = 0 .. len(c) - 1.

These are convenience wrappers over :func:`jetrl.rl.batch.completion_logprobs`, the one
implementation the GRPO trainer uses, for callers that hold plain token lists.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from jetrl.rl.batch import RolloutBatch, completion_logprobs


def batch_trainer_logprobs(model: nn.Module, prompts: Sequence[Sequence[int] | Tensor],
                           completions: Sequence[Sequence[int] | Tensor], temperature: float = 1.0) -> list[Tensor]:
    """Per-pair (len(completion),) fp32 logprobs of each completion after its prompt, in one forward."""
    if len(prompts) != len(completions) or not prompts:
        raise ValueError(f"need one completion per prompt, got {len(prompts)} prompts and {len(completions)} completions")
    prompts = [torch.as_tensor(p, dtype=torch.int64).flatten().tolist() for p in prompts]
    completions = [torch.as_tensor(c, dtype=torch.int64).flatten().tolist() for c in completions]
    for i, (p, c) in enumerate(zip(prompts, completions)):
        if not p or not c:
            raise ValueError(f"pair {i}: prompt ({len(p)} tokens) and completion ({len(c)}) must be non-empty")
    batch = RolloutBatch.build(prompts, completions, [[0.0] * len(c) for c in completions],
                               torch.zeros(len(prompts)), [True] * len(prompts))
    logprobs, _ = completion_logprobs(model, batch, temperature)
    return [row[: len(c)] for row, c in zip(logprobs, completions)]


def trainer_logprobs(model: nn.Module, prompt_ids: Sequence[int] | Tensor, completion_ids: Sequence[int] | Tensor,
                     temperature: float = 1.0) -> Tensor:
    """(len(completion),) fp32 logprobs of ``completion_ids`` after ``prompt_ids``."""
    return batch_trainer_logprobs(model, [prompt_ids], [completion_ids], temperature)[0]
