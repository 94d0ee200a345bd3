"""Advantages, the clipped loss, rollout correction and mismatch metrics on hand-computed examples."""

import math

import pytest
import torch

from jetrl.rl.advantages import group_advantages, zero_signal_groups
from jetrl.rl.correction import rollout_correction_weights
from jetrl.rl.loss import k3_kl, policy_loss
from jetrl.rl.metrics import MISMATCH_KEYS, mismatch_metrics


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0])  # groups of 2: (1,0) (0,1) (2,2)
    adv = group_advantages(rewards, 2, "none")
    assert torch.equal(adv, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0]))
    std = math.sqrt(0.5)  # unbiased std of (1, 0)
    adv = group_advantages(rewards, 2, "group", eps=0.0)
    assert torch.allclose(adv[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]) / std)
    assert torch.equal(adv[4:], torch.zeros(2))  # equal rewards: no signal, exactly 0
    assert zero_signal_groups(rewards, 2).tolist() == [False, False, True]
    batch = group_advantages(rewards, 2, "batch", eps=0.0)
    assert torch.allclose(batch[:2], torch.tensor([0.5, -0.5]) / rewards.std())
    with pytest.raises(ValueError, match="multiple of num_generations=4"):
        group_advantages(rewards, 4)


def test_policy_loss_by_hand():
    lp = torch.tensor([[math.log(1.5), math.log(0.5), 0.0]])
    old = torch.zeros(1, 3)
    adv = torch.tensor([1.0])
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the last token is padding
    # ratios 1.5 (clipped to 1.2 for A>0) and 0.5 (A>0: min(0.5, 0.8) = 0.5)
    loss, stats = policy_loss(lp, old, adv, mask, epsilon_low=0.2, epsilon_high=0.2, loss_type="bnpo")
    assert loss.item() == pytest.approx(-(1.2 + 0.5) / 2)
    assert stats["clip_ratio/high_mean"] == pytest.approx(0.5) and stats["clip_ratio/low_mean"] == 0.0
    # clip-higher: eps_high = 0.6 lets 1.5 through
    loss, _ = policy_loss(lp, old, adv, mask, epsilon_low=0.2, epsilon_high=0.6, loss_type="bnpo")
    assert loss.item() == pytest.approx(-(1.5 + 0.5) / 2)
    # negative advantage: ratio 0.5 clipped at 0.8 -> -min(-0.5, -0.8) = 0.8; ratio 1.5 -> 1.5
    loss, stats = policy_loss(lp, old, -adv, mask, loss_type="bnpo")
    assert loss.item() == pytest.approx((1.5 + 0.8) / 2)
    assert stats["clip_ratio/low_mean"] == pytest.approx(0.5)


def test_gspo_sequence_ratio_by_hand():
    """importance_sampling_level='sequence' (GSPO): one ratio per completion, exp of its tokens' mean log ratio,
    clipped as a whole; padding is outside the mean. 'sequence_token' (GSPO-token) has the same values and, under
    the per-sequence mean (loss_type 'grpo'), the same gradient."""
    lp = torch.tensor([[math.log(1.5), math.log(0.5), 7.0], [math.log(1.1), 0.0, 0.0]], requires_grad=True)
    old = torch.zeros(2, 3)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])  # row 0's last token is padding (its lp never counts)
    r0, r1 = math.sqrt(1.5 * 0.5), 1.1 ** (1 / 3)  # geometric means: 0.866, 1.032
    kw = {"epsilon_low": 0.1, "epsilon_high": 0.1, "loss_type": "grpo"}
    loss, stats = policy_loss(lp, old, adv, mask, importance_sampling_level="sequence", **kw)
    # row 0: A > 0, ratio 0.866 below the clip (min picks the ratio); row 1: A < 0, -min(-1.032, -0.9) = 1.032
    assert loss.item() == pytest.approx((-r0 + r1) / 2)
    assert stats["ratio_mean"] == pytest.approx((2 * r0 + 3 * r1) / 5)
    (grad,) = torch.autograd.grad(loss, lp)
    # d ratio_i / d lp_it = ratio_i / |y_i|, and the mean over the two sequences halves it
    assert grad[0, :2].tolist() == pytest.approx([-r0 / 2 / 2] * 2) and grad[0, 2] == 0
    assert grad[1].tolist() == pytest.approx([r1 / 3 / 2] * 3)
    token, _ = policy_loss(lp, old, adv, mask, importance_sampling_level="sequence_token", **kw)
    assert token.item() == pytest.approx(loss.item())
    assert torch.allclose(torch.autograd.grad(token, lp)[0], grad)
    # clipped as a whole: a sequence ratio past 1 + eps_high with A > 0 gets no gradient, though one token is below
    lp2 = torch.tensor([[math.log(2.0), math.log(0.9)]], requires_grad=True)
    loss, stats = policy_loss(lp2, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2),
                              importance_sampling_level="sequence", **kw)
    assert loss.item() == pytest.approx(-1.1) and stats["clip_ratio/high_mean"] == 1.0
    assert torch.equal(torch.autograd.grad(loss, lp2)[0], torch.zeros(1, 2))
    with pytest.raises(ValueError, match="importance_sampling_level='seq'; use one of"):
        policy_loss(lp, old, adv, mask, importance_sampling_level="seq")


def test_aggregations_and_padding_contributes_nothing():
    lp = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.0, 0.0]], requires_grad=True)
    old = lp.detach().clone()
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # at ratio 1, per-token loss is -A
    grpo, _ = policy_loss(lp, old, adv, mask, loss_type="grpo")
    assert grpo.item() == pytest.approx((-1.0 + 2.0) / 2)
    bnpo, _ = policy_loss(lp, old, adv, mask, loss_type="bnpo")
    assert bnpo.item() == pytest.approx((-3.0 + 2.0) / 4)
    dapo, _ = policy_loss(lp, old, adv, mask, loss_type="dapo", num_items_in_batch=8)
    assert dapo.item() == pytest.approx((-3.0 + 2.0) / 8)
    dr, _ = policy_loss(lp, old, adv, mask, loss_type="dr_grpo", max_completion_length=5)
    assert dr.item() == pytest.approx((-3.0 + 2.0) / 10)
    bnpo.backward()
    assert torch.equal(lp.grad[1, 1:], torch.zeros(2)), "masked (prompt/padding) tokens must get no gradient"
    with pytest.raises(ValueError, match="loss_type"):
        policy_loss(lp, old, adv, mask, loss_type="ppo")


def test_kl_term_and_weights():
    lp = torch.tensor([[0.0, -1.0]])
    ref = torch.tensor([[-0.5, -1.0]])
    kl = k3_kl(lp, ref)
    assert kl[0, 0].item() == pytest.approx(math.exp(-0.5) + 0.5 - 1) and kl[0, 1].item() == 0.0
    mask = torch.ones(1, 2)
    loss, stats = policy_loss(lp, lp, torch.tensor([0.0]), mask, beta=0.1, ref_logprobs=ref, loss_type="bnpo")
    assert loss.item() == pytest.approx(0.1 * kl.mean().item()) and stats["kl"] == pytest.approx(kl.mean().item())
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(lp, lp, torch.tensor([0.0]), mask, beta=0.1)
    w = torch.tensor([[0.0, 1.0]])
    loss, _ = policy_loss(lp, lp, torch.tensor([1.0]), mask, token_weights=w, loss_type="bnpo")
    assert loss.item() == pytest.approx(-0.5)
    # the correction weights the policy-gradient term only (as TRL's importance-sampling ratio): a token MIS masks
    # out still pays its KL to the reference
    lp_kl = lp.clone().requires_grad_(True)
    loss, _ = policy_loss(lp_kl, lp_kl.detach(), torch.tensor([0.0]), mask, beta=0.1, ref_logprobs=ref,
                          token_weights=torch.tensor([[0.0, 1.0]]), loss_type="bnpo")
    assert loss.item() == pytest.approx(0.1 * kl.mean().item())
    loss.backward()
    assert lp_kl.grad[0, 0].item() == pytest.approx(0.1 * (1 - math.exp(-0.5)) / 2)


def test_rollout_correction():
    old = torch.log(torch.tensor([[1.0, 3.0, 0.2, 1.0]]))
    rollout = torch.zeros(1, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    none, stats = rollout_correction_weights(old, rollout, mask, "none")
    assert none is None and stats == {}
    tis, stats = rollout_correction_weights(old, rollout, mask, "tis", 2.0)
    assert torch.allclose(tis, torch.tensor([[1.0, 2.0, 0.2, 1.0]]))
    assert stats["rollout_corr/tis_clipped_fraction"] == pytest.approx(1 / 3)
    mis, stats = rollout_correction_weights(old, rollout, mask, "mis", 2.0)
    assert torch.equal(mis, torch.tensor([[1.0, 0.0, 0.0, 1.0]]))
    assert stats["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="must be > 1"):
        rollout_correction_weights(old, rollout, mask, "tis", 0.5)
    # a sequence's ratio: the product of its tokens' (1 * 3 * 0.2 = 0.6), or their geometric mean (0.843); padding
    # (here inf) never counts; every token of the sequence gets the sequence's weight
    old2 = torch.cat([old, torch.log(torch.tensor([[1.5, 1.5, 1.5, float("inf")]]))])
    mask2 = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    seq, stats = rollout_correction_weights(old2, torch.zeros(2, 4), mask2, "tis", 2.0, "sequence")
    assert torch.allclose(seq, torch.tensor([[0.6] * 4, [2.0] * 4]))  # 1.5^3 = 3.375 truncated at C = 2
    assert stats["rollout_corr/tis_clipped_fraction"] == pytest.approx(0.5)
    seq, stats = rollout_correction_weights(old2, torch.zeros(2, 4), mask2, "mis", 2.0, "sequence")
    assert torch.equal(seq, torch.tensor([[1.0] * 4, [0.0] * 4]))  # a whole completion rejected
    geo, _ = rollout_correction_weights(old2, torch.zeros(2, 4), mask2, "mis", 2.0, "geometric")
    assert torch.equal(geo, torch.ones(2, 4))  # 0.6^(1/3) = 0.84 and 1.5: both kept
    with pytest.raises(ValueError, match="level 'seq'; use one of"):
        rollout_correction_weights(old, rollout, mask, "tis", 2.0, "seq")


def test_mismatch_metrics_by_hand():
    lp_t = torch.log(torch.tensor([[0.5, 0.25, 0.9]]))
    lp_r = torch.log(torch.tensor([[0.25, 0.25, 0.1]]))
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    m = mismatch_metrics(lp_t, lp_r, mask)
    assert set(m) == set(MISMATCH_KEYS)
    d = math.log(2)  # lp_t - lp_r on token 0; 0 on token 1
    assert m["rollout_corr/kl"] == pytest.approx(-d / 2)
    assert m["rollout_corr/k3_kl"] == pytest.approx((math.exp(d) - 1 - d) / 2)
    assert m["training/rollout_probs_diff_mean"] == pytest.approx(0.125)
    assert m["training/rollout_probs_diff_max"] == pytest.approx(0.25)
    assert m["token_mult_prob_error"] == pytest.approx((2 + 1) / 2)
    assert m["rollout_corr/log_ppl_abs_diff"] == pytest.approx(d / 2)
    same = mismatch_metrics(lp_t, lp_t, mask)
    assert same["rollout_corr/kl"] == 0 and same["token_mult_prob_error"] == 1.0


def test_learning_rate_schedules_by_hand_and_as_hugging_face_computes_them():
    """Warmup (s + 1) / W, then constant, or linear / cosine decay to 0 at the last scheduled step, equal after warmup
    to transformers' get_linear_schedule_with_warmup / get_cosine_schedule_with_warmup (jetrl/rl/schedule.py)."""
    import transformers

    from jetrl.rl.schedule import learning_rate_at

    base, warmup, total = 2e-3, 3, 20
    assert [learning_rate_at(s, base, warmup, total, "constant") for s in (0, 1, 2, 3, 19, 30)] == pytest.approx(
        [base / 3, 2 * base / 3, base, base, base, base])
    assert learning_rate_at(3 + 17 // 2, base, warmup, total, "cosine") == pytest.approx(base * 0.5 * (
        1 + math.cos(math.pi * 8 / 17)))
    assert learning_rate_at(total, base, warmup, total, "linear") == 0 == learning_rate_at(99, base, warmup, total,
                                                                                          "cosine")
    for kind, make in (("linear", transformers.get_linear_schedule_with_warmup),
                       ("cosine", transformers.get_cosine_schedule_with_warmup)):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base)
        scheduler = make(optimizer, warmup, total)
        for s in range(total + 1):  # past the end HF's cosine rises again; jetrl's stays at 0
            if s >= warmup:
                assert learning_rate_at(s, base, warmup, total, kind) == pytest.approx(scheduler.get_last_lr()[0],
                                                                                      abs=1e-12), (kind, s)
            optimizer.step()
            scheduler.step()
    with pytest.raises(ValueError, match="lr_scheduler_type='step'; use one of"):
        learning_rate_at(0, base, 0, total, "step")
