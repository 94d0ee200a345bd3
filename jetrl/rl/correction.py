"""Rollout correction for off-policy sampling: truncated IS (TIS) and masking (MIS / IcePop), per token or per sequence.

When the sampler is not the policy being trained (``fp8_rollout``: BF16 training, FP8
rollout), tokens were drawn from pi_rollout but the loss assumes pi_old. Importance weights
from the trainer's old logprobs and the rollout's logprobs, at ``level`` (verl's ``rollout_is`` /
``rollout_rs`` levels):

    token:      rho_t = exp(old_lp_t - rollout_lp_t)                        each token its own
    sequence:   rho_i = exp(sum_t m_it (old_lp_it - rollout_lp_it))         the sequence's IS ratio, every token
    geometric:  rho_i = exp(sum_t m_it (...) / sum_t m_it)                  its per-token geometric mean (GSPO's
                                                                            ratio; length-independent)

    TIS  (truncated IS):                w = min(rho, C)          C = 2 by default
    MIS  (masked IS / IcePop, two-sided): w = 1[1/C <= rho <= C]

A sequence-level MIS rejects a whole completion (verl's sequence rejection sampling), which is what
``importance_sampling_level='sequence'`` (GSPO) needs: its ratio mixes every token of the sequence, so
masking one token would not take that token out (loss.py).

The weights are detached and multiply the per-token loss (see ``loss.policy_loss``). Both are
off by default, so ``fp8_rollout`` runs the way verl and NeMo-RL run it without correction.
Under ``jet`` the rollout is the training graph and rho_t is 1 up to rounding.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from jetrl.rl.loss import sequence_log_ratio

CorrectionMode = Literal["none", "tis", "mis"]
CORRECTION_LEVELS = ("token", "sequence", "geometric")


def rollout_correction_weights(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, mode: CorrectionMode = "none", threshold: float = 2.0,
    level: str = "token",
) -> tuple[Tensor | None, dict[str, float]]:
    """(weights (B, T) or None, stats). ``threshold`` is C (> 1); ``level`` as in the module docstring."""
    if mode == "none":
        return None, {}
    if threshold <= 1.0:
        raise ValueError(f"rollout correction threshold C must be > 1, got {threshold}")
    if level not in CORRECTION_LEVELS:
        raise ValueError(f"rollout correction level {level!r}; use one of {CORRECTION_LEVELS}")
    with torch.no_grad():
        mask = mask.to(old_logprobs.dtype)
        log_rho = old_logprobs - rollout_logprobs
        if level != "token":
            log_rho = sequence_log_ratio(log_rho, mask, mean=level == "geometric").expand_as(mask)
        rho = torch.exp(log_rho.clamp(-20, 20))  # IS weights bounded to [e^-20, e^20]
        n = mask.sum().clamp_min(1)
        if mode == "tis":
            weights = rho.clamp(max=threshold)
            stats = {"rollout_corr/tis_clipped_fraction": float(((rho > threshold) * mask).sum() / n)}
        elif mode == "mis":
            keep = (rho >= 1.0 / threshold) & (rho <= threshold)
            weights = keep.to(rho.dtype)
            stats = {"rollout_corr/rollout_rs_masked_fraction": float(((~keep) * mask).sum() / n)}
        else:
            raise ValueError(f"rollout correction mode {mode!r}; use 'none', 'tis' or 'mis'")
        stats["rollout_corr/rollout_is_mean"] = float((rho * mask).sum() / n)
    return weights, stats
