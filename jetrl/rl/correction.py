"""Rollout correction for off-policy sampling: token-level TIS and masking (MIS / IcePop).

When the sampler is not the policy being trained (``fp8_rollout``: BF16 training, FP8
rollout), tokens were drawn from pi_rollout but the loss assumes pi_old. Importance weights
per token, from the trainer's old logprobs and the rollout's logprobs:

    rho_t = exp(old_lp_t - rollout_lp_t)

    TIS  (truncated IS, verl ``rollout_is=token``):  w_t = min(rho_t, C)          C = 2 by default
    MIS  (masked IS / IcePop, two-sided):            w_t = 1[1/C <= rho_t <= C]

The weights are detached and multiply the per-token loss (see ``loss.policy_loss``). Both are
off by default, so ``fp8_rollout`` runs the way verl and NeMo-RL run it without correction.
Under ``jet`` the rollout is the training graph and rho_t is 1 up to rounding.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

CorrectionMode = Literal["none", "tis", "mis"]


def rollout_correction_weights(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, mode: CorrectionMode = "none", threshold: float = 2.0
) -> tuple[Tensor | None, dict[str, float]]:
    """(weights (B, T) or None, stats). ``threshold`` is C (> 1)."""
    if mode == "none":
        return None, {}
    if threshold <= 1.0:
        raise ValueError(f"rollout correction threshold C must be > 1, got {threshold}")
    with torch.no_grad():
        log_rho = (old_logprobs - rollout_logprobs).clamp(-20, 20)  # IS weights bounded to [e^-20, e^20]
        rho = torch.exp(log_rho)
        mask = mask.to(rho.dtype)
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
