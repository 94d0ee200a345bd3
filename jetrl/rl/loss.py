"""The clipped policy-gradient loss of GRPO/DAPO, as one pure function of per-token tensors.

Per completion token t of sequence i (mask m_it = 1 for completion tokens, 0 for prompt and
padding, so those contribute nothing):

    ratio_it = exp(lp_it - old_lp_it)
    l_it     = -min(ratio_it A_i, clip(ratio_it, 1 - eps_low, 1 + eps_high) A_i) w_it   PPO-clip, weighted by
                                                                                     the rollout correction (TIS/MIS)
             + beta * k3_it,   k3_it = exp(ref_it - lp_it) - (ref_it - lp_it) - 1     KL to a reference, unweighted

``importance_sampling_level`` (TRL's name) picks the ratio. "token" is the one above. "sequence" is GSPO's (Zheng et
al., 2025): one ratio per sequence, the geometric mean of its tokens' ratios,

    ratio_i  = exp(sum_t m_it (lp_it - old_lp_it) / sum_t m_it)       for every token t of sequence i

clipped as a whole (GSPO clips far tighter than PPO: eps_low = 3e-4, eps_high = 4e-4 in its paper). "sequence_token"
is GSPO-token: the value of ratio_i with each token's own gradient, ratio_it = sg[ratio_i] exp(lp_it - sg[lp_it]),
for per-token advantages. The rollout correction's weights still multiply each token's term: under "sequence" a
token that a token-level MIS rejects adds no term, but its log ratio stays in its sequence's mean, so the other
tokens' terms carry its gradient; under "sequence_token" (and "token") it gets none. With GSPO, correct at the
sequence level (``rollout_correction_level``, correction.py), which weights or rejects whole completions. The clip
fractions count tokens, a clipped sequence's every token (TRL counts sequences at this level).

The correction weights the policy-gradient term only, as TRL weights it by its importance-sampling ratio: they
correct for the sampler being another policy, which the KL to the reference does not depend on.

eps_high > eps_low is DAPO's clip-higher. Aggregation (TRL's ``loss_type`` names):

    "grpo"     mean over sequences of (sum_t m l / sum_t m)         sequence-level mean
    "bnpo"     sum_it m l / sum_it m                                 token-level, this micro-batch
    "dapo"     sum_it m l / num_items_in_batch                       token-level over one optimizer step's
                                                                    micro-batches (the trainer passes their
                                                                    token count: grad accumulation is exact)
    "dr_grpo"  sum_it m l / (num_sequences * max_completion_length)

Returns the loss and detached statistics (clip fractions, mean ratio, KL).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

LossType = Literal["grpo", "bnpo", "dapo", "dr_grpo"]
LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence", "sequence_token")


def k3_kl(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimator of KL(pi || ref): exp(ref - lp) - (ref - lp) - 1 (>= 0, unbiased)."""
    delta = ref_logprobs - logprobs
    return torch.exp(delta) - delta - 1


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    loss_type: LossType = "dapo",
    beta: float = 0.0,
    ref_logprobs: Tensor | None = None,
    token_weights: Tensor | None = None,
    num_items_in_batch: int | float | None = None,
    max_completion_length: int | None = None,
    importance_sampling_level: str = "token",
) -> tuple[Tensor, dict[str, float]]:
    """Loss over (B, T) per-token tensors; ``advantages`` is (B,) or (B, T). See the module docstring."""
    mask = mask.to(logprobs.dtype)
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    ratio = torch.exp(_log_ratio(logprobs, old_logprobs, mask, importance_sampling_level))
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    if token_weights is not None:
        per_token = per_token * token_weights.detach()
    kl = None
    if beta != 0.0:
        if ref_logprobs is None:
            raise ValueError("beta > 0 needs ref_logprobs (the reference model's per-token logprobs)")
        kl = k3_kl(logprobs, ref_logprobs)
        per_token = per_token + beta * kl
    loss = _aggregate(per_token, mask, loss_type, num_items_in_batch, max_completion_length)

    with torch.no_grad():
        n = mask.sum().clamp_min(1)
        low = ((ratio < 1 - epsilon_low) & (adv < 0)).to(mask.dtype)
        high = ((ratio > 1 + epsilon_high) & (adv > 0)).to(mask.dtype)
        stats = {
            "clip_ratio/low_mean": float((low * mask).sum() / n),
            "clip_ratio/high_mean": float((high * mask).sum() / n),
            "clip_ratio/region_mean": float(((low + high) * mask).sum() / n),
            "ratio_mean": float((ratio * mask).sum() / n),
        }
        if kl is not None:
            stats["kl"] = float((kl * mask).sum() / n)
    return loss, stats


def sequence_log_ratio(log_ratio: Tensor, mask: Tensor, mean: bool = True) -> Tensor:
    """(B, 1): a sequence's log ratio from its tokens' (B, T), over its completion tokens only (positions outside
    ``mask`` never count, whatever they hold): their mean -- the log of the geometric mean of the tokens' ratios, GSPO's
    -- or, ``mean=False``, their sum -- the log of the sequence's importance ratio (correction.py)."""
    total = torch.where(mask > 0, log_ratio, 0.0).sum(-1, keepdim=True)
    return total / mask.sum(-1, keepdim=True).clamp_min(1) if mean else total


def _log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor, level: str) -> Tensor:
    """log ratio_it at ``level`` (the module docstring): (B, T), or (B, 1) for "sequence"."""
    log_ratio = logprobs - old_logprobs
    if level == "token":
        return log_ratio
    if level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"importance_sampling_level={level!r}; use one of {IMPORTANCE_SAMPLING_LEVELS}")
    sequence = sequence_log_ratio(log_ratio, mask)
    if level == "sequence":
        return sequence
    return sequence.detach() + logprobs - logprobs.detach()


def _aggregate(per_token: Tensor, mask: Tensor, loss_type: str, num_items_in_batch, max_completion_length) -> Tensor:
    masked = per_token * mask
    if loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp_min(1)).mean()
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp_min(1)
    if loss_type == "dapo":
        denom = num_items_in_batch if num_items_in_batch is not None else mask.sum().clamp_min(1)
        return masked.sum() / denom
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length")
        return masked.sum() / (per_token.shape[0] * max_completion_length)
    raise ValueError(f"loss_type={loss_type!r}; use one of {LOSS_TYPES}")
