"""Trainer-side logprobs of given completion tokens: the reference for rollout logprobs.

Why a separate function: the policy-gradient ratio, and every mismatch metric of design.md §6
(``rollout_corr/kl``, ``training/rollout_probs_diff_*``, ...), compare the logprob the rollout
engine reported for a sampled token with the one the trainer computes for the same token. The
trainer side is one full causal forward over prompt + completion in the *train* precision phase
(the default phase: no ``precision_phase`` context here), at temperature 1 unless asked:

    lp_t[j] = log_softmax(logits[P - 1 + j] / T)[c_j],    j = 0 .. len(c) - 1

where P is the prompt length and logits[i] predicts token i + 1. Softmax is taken in fp32 on
whatever dtype the lm_head returns (the engine's sampler does the same). Gradients flow if
enabled, so the GRPO loss can use it directly.

Batched: right padding, positions 0..L-1 and plain causal attention (no mask), which leaves
every real token's logits exactly as in an unpadded forward, up to GEMM batch-shape rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn


def token_logprobs(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / T) at ``tokens``, in fp32. logits (..., T, V), tokens (..., T) -> (..., T)."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    return torch.log_softmax(z, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)


def trainer_logprobs(
    model: nn.Module,
    prompt_ids: Sequence[int] | Tensor,
    completion_ids: Sequence[int] | Tensor,
    temperature: float = 1.0,
) -> Tensor:
    """(len(completion),) fp32 logprobs of ``completion_ids`` after ``prompt_ids``, one forward."""
    return batch_trainer_logprobs(model, [prompt_ids], [completion_ids], temperature)[0]


def batch_trainer_logprobs(
    model: nn.Module,
    prompts: Sequence[Sequence[int] | Tensor],
    completions: Sequence[Sequence[int] | Tensor],
    temperature: float = 1.0,
) -> list[Tensor]:
    """Per-pair logprobs of each completion after its prompt, in one right-padded forward."""
    if len(prompts) != len(completions) or not prompts:
        raise ValueError(
            f"need one completion per prompt, got {len(prompts)} prompts and {len(completions)} completions"
        )
    device = model.model.embed_tokens.weight.device
    pairs = [
        (torch.as_tensor(p, dtype=torch.int64).flatten(), torch.as_tensor(c, dtype=torch.int64).flatten())
        for p, c in zip(prompts, completions)
    ]
    for i, (p, c) in enumerate(pairs):
        if p.numel() == 0 or c.numel() == 0:
            raise ValueError(f"pair {i}: prompt ({p.numel()} tokens) and completion ({c.numel()}) must be non-empty")
    length = max(p.numel() + c.numel() for p, c in pairs)
    ids = torch.zeros(len(pairs), length, dtype=torch.int64)
    for row, (p, c) in enumerate(pairs):
        ids[row, : p.numel() + c.numel()] = torch.cat([p, c])
    hidden = model.hidden_states(ids.to(device))  # (B, L, hidden)
    out = []
    for row, (p, c) in enumerate(pairs):
        start = p.numel() - 1
        logits = model.logits_from_hidden(hidden[row, start : start + c.numel()])  # (len(c), V)
        out.append(token_logprobs(logits, c.to(device), temperature))
    return out
