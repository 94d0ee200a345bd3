"""GRPOTrainer: the RL loop, in TRL's vocabulary, on one shared precision flow.

``GRPOTrainer(model, reward_funcs, args, train_dataset, ...)`` then ``.train()``. One RL step:

    rollout       engine.generate on the trainer's own modules (precision_phase "rollout")  rollout.py
    old logprobs  recomputed by a no-grad trainer forward, or reused from the rollout (only
                  for recipes whose rollout graph is the training graph, ``jet`` and ``jet_kv``)
    mismatch      design.md §6 metrics: trainer vs rollout logprobs of the sampled tokens   metrics.py
    correction    TIS / MIS weights from old vs rollout logprobs (off by default)           correction.py
    update        num_iterations epochs of micro-batches, rows of similar length together
                  (micro_batches.py): policy_loss (loss.py), gradient accumulation, clipping,
                  a non-finite check, AdamW, then every FP8 weight is
                  quantized once for the new version (refresh_weight_caches; on CUDA replayed
                  from a CUDA graph, refresh_graph.py); with grpo.train_cuda_graphs
                  (on CUDA, by default up to 3.5B parameters) the decoder layers'
                  forward+backward replay from CUDA graphs                      train_graphs.py

Data parallel (torchrun, ``replicas``): each rank rolls out its block of the step's prompts on its
own replica and the ranks sum gradients before each optimizer step, with every loss weight taken
over all ranks' micro-batches (replicas.py gives the math); one process runs no collective. With
``grpo.shard_weights`` each rank holds 1/N of every FP8 layer's master weight (jetrl/fp8/weight_shard.py): the
layers reduce-scatter their gradients in backward, so the ranks run their micro-batches in lockstep.

This file only orchestrates; the math lives in the pure functions it calls. The recipe's
rollout-subgraph check runs in the constructor, so an undeclared off-policy flow never starts.
Everything random derives from ``(args.seed, step)``, which is what makes ``resume`` exact.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from jetrl.data import encode_prompts
from jetrl.data.records import column_names
from jetrl.engine import Engine
from jetrl.engine.sampling import prompt_seed
from jetrl.fp8 import (
    Recipe,
    WeightRefresh,
    check_model_precision,
    check_rollout_subgraph,
    convert_to_float8,
    get_recipe,
    model_recipe,
    refresh_weight_caches,
    track_optimizer,
)
from jetrl.fp8.frozen import frozen_copy
from jetrl.fp8.weight_shard import shard_fp8_weights, take_reduction_checksum
from jetrl.models.stacked_projections import remove_stacked_projections
from jetrl.rewards import math_reward, resolve_reward_funcs
from jetrl.rl.batch import RolloutBatch, completion_logprobs
from jetrl.rl.config import GRPOConfig
from jetrl.rl.correction import rollout_correction_weights
from jetrl.rl.loss import policy_loss
from jetrl.rl.memory import oom_advice
from jetrl.rl.metrics import mismatch_metrics, mismatch_weights
from jetrl.rl.micro_batches import plan
from jetrl.rl.replicas import Replicas, with_weight
from jetrl.rl.rollout import rollout
from jetrl.rl.schedule import learning_rate_at
from jetrl.rl.train_graphs import TrainingGraphs, auto_enabled, auto_length_multiple, unsupported_reason


class NonFiniteStepError(RuntimeError):
    """A step's loss or gradient was NaN/Inf and ``nonfinite_step='stop'``."""


class GRPOTrainer:
    def __init__(self, model: nn.Module, reward_funcs: str | Callable | Sequence[str | Callable],
                 args: GRPOConfig, train_dataset: Sequence[dict[str, Any]], *, tokenizer: Any,
                 recipe: Recipe | str = "jet", system_prompt: str | None = None,
                 accuracy_func: Callable | None = math_reward, engine_kwargs: dict | None = None,
                 replicas: Replicas | None = None, prompt_ids: list[list[int]] | None = None) -> None:
        """``prompt_ids``: ``train_dataset``'s prompts already encoded (``encode_prompts`` with this
        ``system_prompt`` and ``args``), as ``jetrl train`` does before its model loads; None encodes them here."""
        if not train_dataset:
            raise ValueError("train_dataset is empty: give at least one record")
        self.args, self.tokenizer = args, tokenizer
        self.replicas = replicas or Replicas()
        self.local_generation_batch_size = args.generation_batch_size_per_rank(self.replicas.world_size)
        context = model.config.max_position_embeddings
        if args.max_prompt_length + args.max_completion_length - 1 > context:  # the last token is never fed back
            raise ValueError(f"grpo.max_prompt_length={args.max_prompt_length} + grpo.max_completion_length="
                             f"{args.max_completion_length} exceed the model's context of {context} positions "
                             "(max_position_embeddings); lower one of them")
        self.recipe = get_recipe(recipe) if isinstance(recipe, str) else recipe
        self.policy_report = check_rollout_subgraph(self.recipe)  # raises for an undeclared off-policy flow
        self.model = model if model_recipe(model) is not None else convert_to_float8(model, self.recipe)
        check_model_precision(self.model, self.recipe)
        self.old_logprobs_source = self._resolve_old_logprobs(args.old_logprobs)
        self.reward_funcs = resolve_reward_funcs(reward_funcs)
        self.accuracy_func = accuracy_func
        self.records = list(train_dataset)
        self.column_names = column_names(self.records)  # what every reward call passes, whichever records it scores
        if prompt_ids is not None and len(prompt_ids) != len(self.records):
            raise ValueError(f"prompt_ids holds {len(prompt_ids)} prompts for {len(self.records)} records")
        self.prompt_ids = prompt_ids if prompt_ids is not None else encode_prompts(
            self.records, tokenizer, system_prompt=system_prompt, max_prompt_length=args.max_prompt_length,
            template_kwargs=args.chat_template_kwargs)
        # under jet / jet_kv the reference's FP8 layers hold their codes only (frozen.py)
        self.ref_model = frozen_copy(self.model) if args.beta > 0 else None
        if self.ref_model is not None:  # it scores whole sequences (large M): a stacked BF16 copy would buy nothing
            remove_stacked_projections(self.ref_model)
        self.sharded = args.shard_weights and self.replicas.distributed  # after the reference copied the whole codes
        if self.sharded:
            shard_fp8_weights(self.model, self.replicas.rank, self.replicas.world_size)
        params = list(self.model.parameters())
        # fused AdamW on CUDA: one pass over parameters, gradients and states instead of foreach's dozen
        # (foreach: 38 ms of GPU time per step at 2.8B parameters, bench/profile_training.py); CPU keeps
        # its default implementation
        self.optimizer = self.replicas.optimizer(
            params, torch.optim.AdamW, shard=args.shard_optimizer_state, lr=args.learning_rate,
            weight_decay=args.weight_decay, betas=(args.adam_beta1, args.adam_beta2),
            fused=all(p.is_cuda for p in params) or None)
        # fused AdamW does not bump parameter versions (nor does a sharded optimizer's broadcast of the updated ones):
        # the FP8 caches key on them
        track_optimizer(self.optimizer)
        self.engine = Engine(self.model, tokenizer, max_slots=self.local_generation_batch_size,
                             max_len=args.max_prompt_length + args.max_completion_length, **(engine_kwargs or {}))
        self.train_graphs = self._resolve_train_graphs(args.train_cuda_graphs)
        self.weight_refresh = WeightRefresh(self.model)
        self.step = 0
        self.optimizer_steps = 0
        self.last_lr = self._lr()  # the rate of the last optimizer step (logged), before any: the first one's
        self.nonfinite_steps = 0

    def _resolve_old_logprobs(self, choice: str) -> str:
        """Where pi_old comes from. The rollout's logprobs can stand in for it only where they are the trainer's:
        an on-policy recipe, and sampling from the tempered distribution itself (a top-p / top-k rollout reports the
        logprobs of the truncated distribution it sampled from, which the loss's pi is not); and a rollout correction
        compares the two, so it needs the trainer's pass."""
        args = self.args
        same_graph = self.policy_report["on_policy"] and self.recipe.train.is_fp8 == self.recipe.rollout.is_fp8
        truncated = args.top_p < 1 or args.top_k > 0
        if choice == "auto":
            reuse = same_graph and self.recipe.train.is_fp8 and not truncated and args.rollout_correction == "none"
            return "rollout" if reuse else "recompute"
        if choice == "rollout":
            if not self.policy_report["on_policy"]:
                raise ValueError(f"grpo.old_logprobs='rollout' needs an on-policy recipe; {self.recipe.name!r} is "
                                 "off-policy (its rollout graph differs from training): use 'recompute'")
            if truncated:
                raise ValueError(f"grpo.old_logprobs='rollout' with grpo.top_p={args.top_p} / grpo.top_k={args.top_k}: "
                                 "the rollout's logprobs are of the truncated distribution it sampled from, not the "
                                 "policy the loss trains; use 'recompute' (or 'auto'), or top_p=1 and top_k=0")
            if args.rollout_correction != "none":
                raise ValueError(f"grpo.rollout_correction={args.rollout_correction!r} compares the trainer's old "
                                 "logprobs with the rollout's, which grpo.old_logprobs='rollout' makes the same tensor "
                                 "(every weight 1); use old_logprobs='recompute' (or 'auto'), or "
                                 "rollout_correction='none'")
        return choice

    def _resolve_train_graphs(self, choice: str) -> TrainingGraphs | None:
        if choice == "off":
            return None
        problem = unsupported_reason(self.model)
        if problem and choice == "on":
            raise ValueError(f"grpo.train_cuda_graphs='on' cannot apply: {problem}; use 'auto' or 'off'")
        if problem or (choice == "auto" and not auto_enabled(self.model)):
            return None
        args = self.args
        multiple = args.train_graph_length_multiple
        if multiple == "auto":
            multiple = auto_length_multiple(args.max_prompt_length + args.max_completion_length)
        return TrainingGraphs(self.model, multiple, row_multiple=args.train_graph_row_multiple,
                              capture_on_use=args.train_graph_capture_on_use)

    def graphed_hidden_states(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The CUDA graphs' ``hidden_states``, or None (eager)."""
        return None if self.train_graphs is None else self.train_graphs.hidden_states

    # ------------------------------------------------------------------ data
    def prompt_indices(self, step: int) -> list[int]:
        """The records of RL step ``step``: an epoch-wise permutation seeded by (seed, epoch)."""
        per_step, n = self.args.prompts_per_step, len(self.records)
        out = []
        for k in range(step * per_step, (step + 1) * per_step):
            epoch, pos = divmod(k, n)
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.args.seed * 1_000_003 + epoch))
            out.append(int(perm[pos]))
        return out

    def train(self, on_step: Callable[[int, dict[str, float]], None] | None = None) -> list[dict[str, float]]:
        """Run RL steps until ``args.max_steps``; ``on_step(step, metrics)`` after each (logging, checkpoints)."""
        history = []
        while self.step < self.args.max_steps:
            metrics = self.train_step()
            history.append(metrics)
            if on_step is not None:
                on_step(self.step, metrics)
        return history

    # ------------------------------------------------------------------ one RL step
    def _clock(self) -> float:
        """Wall time after the device's queued work: phase times count their own GPU work, not the
        previous phase's (CUDA runs asynchronously; a sync per phase costs nothing measurable)."""
        device = next(self.model.parameters()).device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.time()

    def train_step(self) -> dict[str, float]:
        args, step, replicas = self.args, self.step, self.replicas
        t0 = self._clock()
        seed = args.seed * 1_000_003 + step
        block = replicas.shard_range(args.prompts_per_step)  # this rank's block of the step's prompts
        step_prompts = self.prompt_indices(step)
        idx = [step_prompts[i] for i in block]
        graphs = self.train_graphs is not None  # what the out-of-memory advice may name
        with oom_advice("rollout", args, step, self.model, graphs):
            # each prompt samples with the seed of its place in the whole step, whichever rank holds it
            batch, metrics, _ = rollout(self.engine, [self.prompt_ids[i] for i in idx],
                                        [self.records[i] for i in idx], self.reward_funcs, args, seed=seed,
                                        accuracy_func=self.accuracy_func,
                                        gather=replicas.gather if replicas.distributed else None,
                                        seeds=[prompt_seed(seed, i) for i in block], column_names=self.column_names)
        t1 = self._clock()
        groups = None if batch is None else self._plan(batch)  # the old-logprob pass and the update share it
        if batch is not None:
            with oom_advice("old_logprobs", args, step, self.model, graphs):
                self._old_logprobs(batch, metrics, groups)
        t2 = self._clock()
        with oom_advice("update", args, step, self.model, graphs):
            self._update(batch, metrics, groups)  # every rank takes part, with or without a batch of its own
        t3 = self._clock()
        self.step += 1
        metrics.update({
            "time/rollout": t1 - t0, "time/old_logprobs": t2 - t1, "time/update": t3 - t2, "time/step": t3 - t0,
            "learning_rate": self.last_lr, "optimizer_steps": self.optimizer_steps,
            "nonfinite_steps": self.nonfinite_steps,
        })
        return replicas.merge_metrics(metrics)

    def _old_logprobs(self, batch: RolloutBatch, metrics: dict[str, float],
                      groups: list[list[torch.Tensor]] | None = None) -> None:
        """Old (and reference) logprobs of ``batch``, over the update's micro-batches ``groups`` (planned here when
        not given)."""
        groups = self._plan(batch) if groups is None else groups
        if self.old_logprobs_source == "recompute":
            with torch.no_grad():
                batch.old_logprobs = self._forward_logprobs(self.model, batch, groups, self.graphed_hidden_states())
            mask = batch.token_mask()
            metrics.update(with_weight(mismatch_metrics(batch.old_logprobs, batch.rollout_logprobs, mask),
                                       mismatch_weights(mask)))
        else:
            batch.old_logprobs = batch.rollout_logprobs.clone()
        if self.ref_model is not None:  # eager: its own (packed) plan when the policy's layers are graphed
            with torch.no_grad():
                batch.ref_logprobs = self._forward_logprobs(
                    self.ref_model, batch, groups if self.train_graphs is None else self._plan(batch, pack=True))

    def _forward_logprobs(self, model: nn.Module, batch: RolloutBatch, groups: list[list[torch.Tensor]],
                          hidden: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        out = torch.zeros(batch.completion_ids.shape)
        for step in groups:
            for rows in step:
                part = completion_logprobs(model, batch.select(rows), self.args.temperature, hidden_states=hidden)[0]
                out[rows, : part.shape[1]] = part.cpu()
        return out

    def _plan(self, batch: RolloutBatch, pack: bool | None = None) -> list[list[torch.Tensor]]:
        """The update's optimizer steps as micro-batches of row indices (micro_batches.py), packed when the layers run
        eagerly (``pack``, by default: no training CUDA graphs, where each shape is a capture). The old-logprob pass
        runs the same micro-batches, so the update's first pass repeats its forwards. ``bnpo`` (a per-micro-batch
        mean) keeps rollout order."""
        args = self.args
        pack = self.train_graphs is None if pack is None else pack
        return plan(batch.prompt_lengths + batch.completion_lengths, batch.completion_lengths,
                    args.per_device_train_batch_size, args.gradient_accumulation_steps,
                    args.group_by_length and args.loss_type != "bnpo", pack=pack)

    def _update(self, batch: RolloutBatch | None, metrics: dict[str, float],
                groups: list[list[torch.Tensor]] | None = None) -> None:
        """``num_iterations`` epochs of optimizer steps over the batch, in the micro-batches ``groups`` (planned here
        when not given). Data parallel, every rank makes as many optimizer steps as the rank with the most rows needs,
        each rank's losses weighted by the counts over all ranks (replicas.py); ``batch`` is None on a rank whose
        groups dynamic sampling dropped entirely."""
        args = self.args
        hidden = self.graphed_hidden_states()
        if batch is None:
            groups = []
        elif groups is None:
            groups = self._plan(batch)
        steps = int(self.replicas.max([len(groups)])[0])
        if steps == 0:  # no rank kept a group
            return
        counts = [0.0] * (3 * steps)  # per optimizer step: tokens, sequences, micro-batches (summed over ranks)
        for g, group in enumerate(groups):
            counts[3 * g: 3 * g + 3] = [sum(float(batch.completion_mask[r].sum()) for r in group),
                                        sum(len(r) for r in group), len(group)]
        counts = self.replicas.sum(counts)
        # sharded weights: the most micro-batches any rank runs in each optimizer step
        lockstep = [int(n) for n in self.replicas.max([len(groups[g]) if g < len(groups) else 0
                                                        for g in range(steps)])] if self.sharded else None
        weights = None
        if batch is not None:
            weights, corr_stats = rollout_correction_weights(batch.old_logprobs, batch.rollout_logprobs,
                                                             batch.completion_mask, args.rollout_correction,
                                                             args.rollout_correction_threshold,
                                                             args.rollout_correction_level)
            metrics.update(with_weight(corr_stats, float(batch.completion_mask.sum())))
        stats_sum: dict[str, float] = {}
        first_pass: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # for reused-logprob mismatch
        entropy_sum = token_count = 0.0  # the loss statistics are token means over every micro-batch of the update
        grad_norms: list[float] = []
        micro = 0
        for iteration in range(args.num_iterations):
            for g in range(steps):
                tokens, sequences, micro_batches = counts[3 * g: 3 * g + 3]
                loss_sum = torch.zeros(())
                for r in groups[g] if g < len(groups) else []:
                    sub = batch.select(r)
                    lp, entropy = completion_logprobs(self.model, sub, args.temperature, with_entropy=True,
                                                      hidden_states=hidden)
                    mask = sub.completion_mask.to(lp.device)
                    loss, stats = policy_loss(
                        lp, sub.old_logprobs.to(lp.device), sub.advantages.to(lp.device), mask,
                        epsilon_low=args.epsilon_low, epsilon_high=args.clip_high, loss_type=args.loss_type,
                        beta=args.beta, ref_logprobs=None if sub.ref_logprobs is None else sub.ref_logprobs.to(lp.device),
                        token_weights=None if weights is None else weights[r][:, : lp.shape[1]].to(lp.device),
                        num_items_in_batch=max(tokens, 1.0), max_completion_length=args.max_completion_length,
                        importance_sampling_level=args.importance_sampling_level)
                    loss = loss * _micro_batch_weight(args.loss_type, len(sub), int(micro_batches), int(sequences))
                    loss.backward()
                    loss_sum = loss_sum.to(loss.device) + loss.detach()
                    micro += 1
                    tokens_here = float(mask.sum())  # each statistic is this micro-batch's token mean
                    for k, v in stats.items():
                        stats_sum[k] = stats_sum.get(k, 0.0) + v * tokens_here
                    entropy_sum += float((entropy * mask).sum())
                    token_count += tokens_here
                    if iteration == 0 and g == 0:  # before this step's first optimizer update
                        first_pass.append((lp.detach().cpu(), sub.rollout_logprobs, sub.token_mask()))
                if self.sharded:  # every rank runs as many backward passes: their layers reduce-scatter together
                    for _ in range(lockstep[g] - (len(groups[g]) if g < len(groups) else 0)):
                        self._null_backward()
                if g >= len(groups) and self.train_graphs is not None:
                    self.train_graphs.bind_grads()  # the zeros this rank adds: the graphs' own gradient tensors
                within = (iteration * steps + g) / (args.num_iterations * steps)  # the rate's position in this step
                grad_norms.append(self._optimizer_step(loss_sum, within))
        if micro:  # token means, whichever rows share a micro-batch (micro_batches.py) and on however many ranks
            means = {k: v / max(token_count, 1.0) for k, v in stats_sum.items()}
            metrics.update(with_weight({**means, "entropy": entropy_sum / max(token_count, 1.0)}, token_count))
        finite = [g for g in grad_norms if math.isfinite(g)]
        metrics["grad_norm"] = sum(finite) / len(finite) if finite else float("nan")
        if self.old_logprobs_source == "rollout" and first_pass:
            metrics.update(_mismatch_of(first_pass))

    def _optimizer_step(self, loss: torch.Tensor, within_step: float = 0.0) -> float:
        """Clip, check and apply the accumulated gradient (data parallel: summed over the ranks first, so every
        replica makes the same decision and the same update); ``within_step``: how far into this RL step's optimizer
        steps this one is, in [0, 1) (its learning rate's position, jetrl/rl/schedule.py)."""
        self.last_lr = self._lr(within_step)
        args = self.args
        self.replicas.reduce_gradients(self.model)
        loss = self.replicas.sum([float(loss)])[0]
        if self.sharded:  # the backward reduce-scatters paired weight with weight on every rank (weight_shard.py)
            mine = take_reduction_checksum()
            high, low = self.replicas.max([mine, -mine])
            if high != -low:
                raise RuntimeError("the data-parallel ranks reduce-scattered their sharded weights' gradients in "
                                   "different orders, so some summed one layer's gradient with another's; this is a "
                                   "jetrl bug (please report it), and grpo.shard_weights=false avoids it")
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = self.replicas.clip_gradients(params, args.max_grad_norm)
        if not (math.isfinite(norm) and math.isfinite(loss)):
            self.optimizer.zero_grad(set_to_none=True)
            self.nonfinite_steps += 1
            message = (f"step {self.step}: non-finite loss ({loss}) or gradient norm ({norm}); "
                       "the update was not applied")
            if args.nonfinite_step == "stop":
                raise NonFiniteStepError(message + " and the run stops (grpo.nonfinite_step='stop'); lower "
                                         "grpo.learning_rate or resume from the last checkpoint")
            if self.replicas.is_main:
                print(f"warning: {message} (skipped; grpo.nonfinite_step='skip')")
            return float("nan")
        for group in self.optimizer.param_groups:
            group["lr"] = self.last_lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        # quantize every FP8 weight once for the new version (on CUDA from a CUDA graph: jetrl/fp8/refresh_graph.py)
        if self.weight_refresh.refresh() and self.train_graphs is not None:
            self.train_graphs.assume_current(self.weight_refresh.keys)
        return norm

    def _null_backward(self) -> None:
        """A backward pass that adds nothing: a zero-weighted loss over one token, for a rank with fewer micro-batches
        in an optimizer step than another when the FP8 weights are sharded (every layer's backward is a collective)."""
        device = next(self.model.parameters()).device
        logits = self.model(torch.zeros((1, 1), dtype=torch.long, device=device))
        (logits.float().sum() * 0.0).backward()

    def _lr(self, within_step: float = 0.0) -> float:
        """The learning rate at ``within_step`` of RL step ``self.step`` (jetrl/rl/schedule.py)."""
        args = self.args
        per_step = args.rl_step_optimizer_steps(self.replicas.world_size)
        return learning_rate_at((self.step + within_step) * per_step, args.learning_rate, args.warmup_steps,
                                args.max_steps * per_step, args.lr_scheduler_type)

    # ------------------------------------------------------------------ state (checkpoints)
    def state_dict(self) -> dict[str, Any]:
        return {"rl_step": self.step, "optimizer_steps": self.optimizer_steps, "nonfinite_steps": self.nonfinite_steps,
                "data_position": self.step * self.args.prompts_per_step, "world_size": self.replicas.world_size}

    def load_state(self, state: dict[str, Any]) -> None:
        self.step = state["rl_step"]
        self.optimizer_steps = state["optimizer_steps"]
        self.nonfinite_steps = state["nonfinite_steps"]
        refresh_weight_caches(self.model)


def _micro_batch_weight(loss_type: str, rows: int, micro_batches: int, sequences: int) -> float:
    """What a micro-batch's loss is multiplied by so that one optimizer step's sum is the loss_type's aggregate over
    its whole accumulation group: ``dapo`` normalizes by the group's tokens already (1); ``grpo`` (a mean over
    sequences) and ``dr_grpo`` (a sum over sequences x max length) weigh by the micro-batch's share of the group's
    sequences, so a short last micro-batch (dynamic sampling) does not count its sequences double; ``bnpo`` averages
    the micro-batches' token means, as TRL's gradient accumulation does."""
    if loss_type == "dapo":
        return 1.0
    if loss_type == "bnpo":
        return 1.0 / micro_batches
    return rows / sequences


def _mismatch_of(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> dict[str, float]:
    width = max(p[0].shape[1] for p in parts)

    def cat(i: int) -> torch.Tensor:
        return torch.cat([torch.nn.functional.pad(p[i], (0, width - p[i].shape[1])) for p in parts])

    return with_weight(mismatch_metrics(cat(0), cat(1), cat(2)), mismatch_weights(cat(2)))
