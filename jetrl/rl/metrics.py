"""Training-vs-rollout mismatch metrics, under the anchors' names (design.md §6).

Per completion token, with lp_r the rollout's logprob and lp_t the trainer's logprob of the
sampled token (masked mean over completion tokens unless stated):

    rollout_corr/kl                   mean(lp_r - lp_t)
    rollout_corr/k3_kl                mean(exp(lp_t - lp_r) - 1 - (lp_t - lp_r))
    training/rollout_probs_diff_mean  mean |exp(lp_t) - exp(lp_r)|        (verl: on probabilities)
    training/rollout_probs_diff_max   max  |exp(lp_t) - exp(lp_r)|
    token_mult_prob_error             mean exp(|lp_t - lp_r|)             (NeMo-RL; 1.0 is perfect)
    rollout_corr/log_ppl_abs_diff     mean over sequences of |log_ppl_t - log_ppl_r|,
                                      log_ppl = -mean_t lp over the sequence's tokens

These are the evidence that a recipe is on-policy: under ``bf16`` and ``jet`` they sit at
rounding level; under ``fp8_rollout`` they do not.
"""

from __future__ import annotations

import torch
from torch import Tensor

MISMATCH_KEYS = (
    "rollout_corr/kl",
    "rollout_corr/k3_kl",
    "training/rollout_probs_diff_mean",
    "training/rollout_probs_diff_max",
    "token_mult_prob_error",
    "rollout_corr/log_ppl_abs_diff",
)


def mismatch_weights(mask: Tensor) -> dict[str, float]:
    """What each of :data:`MISMATCH_KEYS` averages over for ``mask``: its tokens, or for ``log_ppl_abs_diff`` its
    sequences with a token (data-parallel ranks merge their metrics weighted by these: replicas.py)."""
    tokens, sequences = float(mask.sum()), float((mask.sum(-1) > 0).sum())
    return {key: sequences if key == "rollout_corr/log_ppl_abs_diff" else tokens for key in MISMATCH_KEYS}


@torch.no_grad()
def mismatch_metrics(trainer_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> dict[str, float]:
    """All of :data:`MISMATCH_KEYS` from (B, T) per-token logprobs and a completion mask."""
    lp_t, lp_r = trainer_logprobs.double(), rollout_logprobs.double()
    m = mask.to(torch.float64)
    n = m.sum()
    if n == 0:
        raise ValueError("mismatch_metrics: the mask selects no completion token")
    delta = lp_t - lp_r
    probs_diff = (lp_t.exp() - lp_r.exp()).abs()
    per_seq = m.sum(-1)
    has_tokens = per_seq > 0
    log_ppl_t = -(lp_t * m).sum(-1)[has_tokens] / per_seq[has_tokens]
    log_ppl_r = -(lp_r * m).sum(-1)[has_tokens] / per_seq[has_tokens]
    return {
        "rollout_corr/kl": float((-delta * m).sum() / n),
        "rollout_corr/k3_kl": float(((delta.exp() - 1 - delta) * m).sum() / n),
        "training/rollout_probs_diff_mean": float((probs_diff * m).sum() / n),
        "training/rollout_probs_diff_max": float(probs_diff.masked_fill(m == 0, 0).max()),
        "token_mult_prob_error": float((delta.abs().exp() * m).sum() / n),
        "rollout_corr/log_ppl_abs_diff": float((log_ppl_t - log_ppl_r).abs().mean()),
    }
