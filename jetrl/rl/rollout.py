"""One rollout: sample groups with the engine, score them, turn them into a training batch.

    completions   engine.generate(prompts, n = G)           the trainer's own modules, rollout phase
    rewards       r_i = sum_f w_f * reward_f(completion_i)  TRL signature and columns, NaN -> error
    overlong      DAPO: truncated completions get no loss (``mask_truncated_completions``), or
                  the soft penalty  -factor * (L_c - (L_max - L_buf)) / L_buf  over the last L_buf tokens
    advantages    group-normalized (advantages.py)
    dynamic       DAPO dynamic sampling drops groups whose rewards are all equal (no refill:
                  the batch shrinks; the fraction kept is logged)

Returns the :class:`RolloutBatch` plus the step's reward/length metrics under TRL's names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from jetrl.data.records import reward_columns
from jetrl.engine import Engine, SamplingParams
from jetrl.rewards import compute_rewards, is_correct
from jetrl.rewards.registry import call_reward
from jetrl.rl.advantages import group_advantages, zero_signal_groups
from jetrl.rl.batch import RolloutBatch
from jetrl.rl.config import GRPOConfig


def rollout(engine: Engine, prompt_ids: list[list[int]], records: list[dict[str, Any]],
            reward_funcs: dict[str, Callable], args: GRPOConfig, seed: int,
            accuracy_func: Callable | None = None, gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
            seeds: list[int] | None = None,
            column_names: list[str] | None = None) -> tuple[RolloutBatch | None, dict[str, float], list[str]]:
    """Generate, score and batch ``num_generations`` completions of every prompt. Data parallel (replicas.py):
    ``seeds`` pins each prompt's sample streams (by its index in the whole step), and ``gather`` gives every rank's
    rewards from this rank's, for ``scale_rewards='batch'``. ``column_names``: the dataset columns the reward
    functions get (``jetrl.data.records.column_names`` of the whole dataset; default: those ``records`` hold)."""
    G = args.num_generations
    params = SamplingParams(n=G, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_completion_length, seed=seed)
    groups = engine.generate(prompt_ids, params, seeds=seeds)
    completions = [c for group in groups for c in group]
    texts = [c.text if c.text is not None else "" for c in completions]
    columns = reward_columns(records, G, column_names, completion_ids=[c.token_ids for c in completions])
    per_func = compute_rewards(reward_funcs, texts, **columns)
    weights = args.reward_weights or [1.0] * len(per_func)
    if len(weights) != len(per_func):
        raise ValueError(f"grpo.reward_weights has {len(weights)} entries for {len(per_func)} reward functions")
    rewards = torch.zeros(len(completions))
    for w, values in zip(weights, per_func.values()):
        rewards += w * torch.tensor(values, dtype=torch.float32)
    if not torch.isfinite(rewards).all():
        bad = int((~torch.isfinite(rewards)).nonzero()[0])
        raise ValueError(f"reward of completion {bad} is not finite ({rewards[bad].item()}); a reward function "
                         "returned None/NaN for it")
    lengths = torch.tensor([len(c.token_ids) for c in completions], dtype=torch.float32)
    truncated = [c.finish_reason == "length" for c in completions]
    if args.overlong_penalty_length:
        start = args.max_completion_length - args.overlong_penalty_length
        rewards -= args.overlong_penalty_factor * ((lengths - start).clamp(min=0) / args.overlong_penalty_length)

    whole = gather(rewards) if gather is not None and args.scale_rewards == "batch" else None
    advantages = group_advantages(rewards, G, args.scale_rewards, batch_rewards=whole)
    keep = torch.ones(len(completions), dtype=torch.bool)
    if args.dynamic_sampling:
        keep = (~zero_signal_groups(rewards, G)).repeat_interleave(G)
    loss_mask = [not (args.mask_truncated_completions and t) for t in truncated]

    metrics: dict[str, float] = {
        "reward": rewards.mean().item(),
        "reward_std": rewards.view(-1, G).std(dim=1).mean().item() if G > 1 else 0.0,
        "frac_reward_zero_std": zero_signal_groups(rewards, G).float().mean().item(),
        "completions/mean_length": lengths.mean().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": sum(truncated) / len(truncated),
        "dynamic_sampling/kept_fraction": keep.float().mean().item(),
    }
    for name, values in per_func.items():
        metrics[f"rewards/{name}/mean"] = sum(values) / len(values)
    if accuracy_func is not None:
        correct = call_reward(accuracy_func, texts, columns)
        metrics["accuracy"] = sum(is_correct(r) for r in correct) / len(correct)
    if not keep.any():
        return None, metrics, texts
    index = keep.nonzero().flatten().tolist()
    prompts_rep = [prompt_ids[i // G] for i in index]
    batch = RolloutBatch.build(prompts_rep, [completions[i].token_ids for i in index],
                               [completions[i].logprobs for i in index], advantages[index],
                               [loss_mask[i] for i in index])
    return batch, metrics, texts
