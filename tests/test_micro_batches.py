"""Length-grouped micro-batches (jetrl/rl/micro_batches.py, ``grpo.group_by_length``).

The claims under test: grouping keeps every optimizer step's rows and only regroups them within the step, longest
first, and never computes more padded positions than rollout order; packing makes fewer micro-batches, none over the
positions or the logit rows that a micro-batch of ``size`` rows may hold (also with ``size`` = 1 and tied lengths);
the trainer's old logprobs are bit-identical either way on the CPU (a row's logprobs are its own); the update's
gradient (the CPU trainer packs: its layers run eagerly) is the same sum for the losses whose weights come from the
whole step (dapo, grpo) and the very same bits under bnpo, which keeps rollout order; the logged loss statistics
are token means, which the grouping does not move.
"""

import pytest
import torch

from jetrl.data import synthetic_split
from jetrl.models.llama import CausalLM
from jetrl.models.tiny import build_tiny_tokenizer, tiny_model_config
from jetrl.models.tokenizer import Tokenizer
from jetrl.rl.batch import RolloutBatch
from jetrl.rl.config import GRPOConfig
from jetrl.rl.micro_batches import padded_positions, plan
from jetrl.rl.trainer import GRPOTrainer

LENGTHS = torch.tensor([5, 40, 7, 40, 12, 3, 30, 9, 22, 1, 17, 40, 8, 2, 26])  # 15 rows: a short last step
COMPLETIONS = LENGTHS - 1  # one prompt token each


def test_plan_keeps_each_step_rows_and_sorts_within_it():
    plain, grouped = plan(LENGTHS, COMPLETIONS, 3, 2, False), plan(LENGTHS, COMPLETIONS, 3, 2, True)
    assert [[mb.tolist() for mb in step] for step in plain] == [
        [[0, 1, 2], [3, 4, 5]], [[6, 7, 8], [9, 10, 11]], [[12, 13, 14]]]
    assert len(grouped) == len(plain)
    for g_step, p_step in zip(grouped, plain, strict=True):
        assert sorted(torch.cat(g_step).tolist()) == torch.cat(p_step).tolist()  # the same rows per step
        assert [len(mb) for mb in g_step] == [len(mb) for mb in p_step]
        order = LENGTHS[torch.cat(g_step)]
        assert bool((order[:-1] >= order[1:]).all())  # longest first
        assert padded_positions(LENGTHS, g_step) <= padded_positions(LENGTHS, p_step)
    assert grouped[0][0].tolist() == [1, 3, 4]  # ties (rows 1 and 3 at 40) keep rollout order
    assert [[mb.tolist() for mb in step] for step in plan(LENGTHS, COMPLETIONS, 3, 2, False, pack=True)] == [
        [mb.tolist() for mb in step] for step in plain]  # packing applies to grouped rows only


def test_packing_makes_fewer_micro_batches_within_the_longest_ones_positions():
    grouped, packed = plan(LENGTHS, COMPLETIONS, 3, 2, True), plan(LENGTHS, COMPLETIONS, 3, 2, True, pack=True)
    assert [[mb.tolist() for mb in step] for step in packed] == [
        [[1, 3], [4, 2, 0, 5]],  # budget 3 x 40; the short rows fill up first, so no 40 is padded into them
        [[11, 6], [8, 10, 7, 9]],
        [[14, 12, 13]]]  # 3 x 26: all three fit
    for g_step, p_step in zip(grouped, packed, strict=True):
        assert torch.equal(torch.cat(g_step), torch.cat(p_step))  # the same rows in the same order
        budget = 3 * int(LENGTHS[p_step[0]].max())
        assert all(len(mb) * int(LENGTHS[mb].max()) <= budget for mb in p_step)
    wide = torch.tensor([100] + [10] * 20)  # one long row: the short ones share one micro-batch of its budget
    assert [len(mb) for mb in plan(wide, wide - 1, 4, 8, True, pack=True)[0]] == [1, 20]


def test_packing_stays_within_one_row_per_micro_batch():
    """size = 1 (a large model's setting): rows of one length each stay alone, whatever the ties."""
    same = torch.full((4,), 8)
    assert [len(mb) for mb in plan(same, same, 1, 4, True, pack=True)[0]] == [1, 1, 1, 1]
    assert [mb.tolist() for mb in plan(torch.tensor([5, 5, 3]), torch.tensor([4, 4, 2]), 1, 3, True, pack=True)[0]] \
        == [[0], [1], [2]]


def test_packing_never_holds_more_logits_than_rollout_order():
    """The LM head's logits are rows x the longest completion: two rows with long prompts set the positions budget
    (2 x 1024), but four short-prompt rows with 500-token completions would hold 2000 logit rows, twice what any
    micro-batch of 2 rows holds in rollout order (2 x 500)."""
    prompts, completions = torch.tensor([1000, 1000, 10, 10, 10, 10]), torch.tensor([24, 24, 500, 500, 500, 500])
    packed = plan(prompts + completions, completions, 2, 3, True, pack=True)[0]
    assert [mb.tolist() for mb in packed] == [[0, 1], [2, 3], [4, 5]]
    assert all(len(mb) * int(completions[mb].max()) <= 2 * 500 for mb in packed)


def test_grouping_cuts_padding_of_spread_lengths():
    """Lengths spread evenly: rollout order computes ~2x the real tokens at 8 rows per micro-batch, grouped ~1.1x."""
    lengths = torch.randperm(1024, generator=torch.Generator().manual_seed(0))[:256] + 1
    real = int(lengths.sum())
    plain = [mb for step in plan(lengths, lengths, 8, 8, False) for mb in step]
    grouped = [mb for step in plan(lengths, lengths, 8, 8, True) for mb in step]
    packed = [mb for step in plan(lengths, lengths, 8, 8, True, pack=True) for mb in step]
    assert padded_positions(lengths, plain) / real > 1.6 and padded_positions(lengths, grouped) / real < 1.15
    assert len(packed) < 0.7 * len(grouped)  # fewer, fuller micro-batches ...
    assert padded_positions(lengths, packed) < 1.1 * padded_positions(lengths, grouped)  # ... each a little wider


ROWS = 16


def _batch() -> RolloutBatch:
    """ROWS completions of 1-12 tokens after prompts of 3-10, in no order of length."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 60, (int(torch.randint(3, 11, (1,), generator=g)),), generator=g).tolist()
               for _ in range(ROWS)]
    completions = [torch.randint(3, 60, (int(torch.randint(1, 13, (1,), generator=g)),), generator=g).tolist()
                   for _ in range(ROWS)]
    logprobs = [(-torch.rand(len(c), generator=g) * 3).tolist() for c in completions]
    return RolloutBatch.build(prompts, completions, logprobs, torch.randn(ROWS, generator=g),
                              [i != 4 for i in range(ROWS)])


def _trainer(group_by_length: bool, loss_type: str, recipe: str, level: str = "token") -> GRPOTrainer:
    torch.manual_seed(0)
    args = GRPOConfig(learning_rate=1e-9, num_generations=2, generation_batch_size=ROWS, per_device_train_batch_size=4,
                      gradient_accumulation_steps=2, max_prompt_length=32, max_completion_length=12,
                      loss_type=loss_type, max_grad_norm=0.0, old_logprobs="recompute", group_by_length=group_by_length,
                      importance_sampling_level=level)
    train, _ = synthetic_split(16, 0, 0)
    return GRPOTrainer(CausalLM(tiny_model_config()), "math", args, train, tokenizer=Tokenizer(build_tiny_tokenizer()),
                       recipe=recipe)


def _update(group_by_length: bool, loss_type: str, recipe: str, level: str = "token"
            ) -> tuple[torch.Tensor, list[torch.Tensor], dict]:
    """The old logprobs (on completion tokens), each optimizer step's gradient (flattened) and the logged metrics."""
    trainer, batch = _trainer(group_by_length, loss_type, recipe, level), _batch()
    grads: list[torch.Tensor] = []
    trainer.optimizer.register_step_pre_hook(
        lambda opt, *_: grads.append(torch.cat([p.grad.detach().flatten() for p in trainer.model.parameters()])))
    trainer._old_logprobs(batch, {})
    old = batch.old_logprobs * batch.token_mask()  # past a row's completion: its micro-batch's padding
    noise = torch.randn(batch.old_logprobs.shape, generator=torch.Generator().manual_seed(5))
    batch.old_logprobs = batch.old_logprobs + 0.3 * noise  # ratios away from 1: clip statistics that vary by token
    metrics: dict[str, float] = {}
    trainer._update(batch, metrics)
    return old, grads, metrics


@pytest.mark.parametrize(("loss_type", "recipe", "level"), [
    ("dapo", "bf16", "token"), ("grpo", "bf16", "token"), ("bnpo", "bf16", "token"), ("dapo", "jet", "token"),
    ("grpo", "bf16", "sequence")])  # GSPO: each row's ratio is its own tokens' mean, wherever the row is placed
def test_grouped_update_is_the_same_step(loss_type, recipe, level):
    old_plain, grads_plain, plain = _update(False, loss_type, recipe, level)
    old_grouped, grads_grouped, grouped = _update(True, loss_type, recipe, level)
    assert torch.equal(old_plain, old_grouped)  # a row's logprobs do not depend on its neighbours (CPU)
    assert len(grads_plain) == len(grads_grouped) == 2
    for a, b in zip(grads_plain, grads_grouped, strict=True):
        assert float(a.norm()) > 0
        error = float((a - b).norm() / a.norm())
        if loss_type == "bnpo":  # a per-micro-batch mean: the update keeps rollout order
            assert torch.equal(a, b)
        elif recipe == "bf16":  # the same sum in another order
            assert error < 1e-5
        else:  # FP8 wgrad: each 1x128 group along tokens now holds other tokens (and less padding); 2% measured
            assert error < 5e-2
    for key in ("ratio_mean", "clip_ratio/region_mean", "entropy"):  # token means: the grouping does not show
        assert plain[key] == pytest.approx(grouped[key], rel=1e-5, abs=1e-7), key


def test_one_rl_step_plans_its_micro_batches_once():
    """train_step plans the micro-batches once: the old-logprob pass and the update share them (the packing DP is
    host work on every step)."""
    import unittest.mock

    import jetrl.rl.trainer as trainer_module

    trainer = _trainer(True, "dapo", "bf16")
    with unittest.mock.patch.object(trainer_module, "plan", wraps=plan) as planned:
        trainer.train_step()
    assert planned.call_count == 1 and trainer.optimizer_steps >= 1
