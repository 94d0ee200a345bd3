"""Sections (f) and (g): the training phase (``jet`` vs ``bf16``) and one end-to-end RL step (``jet`` and ``jet_kv``
vs ``bf16``).

Both run :class:`~jetrl.rl.GRPOTrainer` itself, so they time the code a real run executes,
on an 8B-shaped random Qwen3 with ``--train-layers`` layers (default 36, Qwen3-8B itself: hidden
4096, SwiGLU 12288, 32/8 heads of 128, vocabulary 151936; 8.19B parameters, of which the embedding
and the untied lm_head are 1.2B and stay BF16 under every recipe). On one H200 the whole model,
its AdamW moments (BF16, as the parameters) and micro-batches of 8 x 1152 tokens fit: (f) peaks at
~119 GiB, (g) adds the engine's KV cache. Fewer layers run quicker, but the BF16 lm_head and
embedding then weigh more than in the real model, so their ratios come out lower (8 layers: (f)
1.18x against 1.26x at 36, docs/benchmarks.md).

The same model object serves every recipe: ``bf16`` first (no conversion), then the trainer
for an FP8 recipe converts it in place (shared parameters). Each trainer gets a fresh AdamW.
In (f), and in (g)'s like-for-like row, old logprobs are *recomputed* by a trainer forward under both
recipes (``old_logprobs="recompute"``), so both do the same work; (g) then also times each FP8 recipe
as shipped (``RL_STEP_CONFIGS``): ``jet`` and ``jet_kv`` with ``old_logprobs="auto"``, which reuses the
rollout's logprobs (their rollout graph is the training graph) and skips that pass.

(f) ``training_phase``: one batch of ``train_batch`` sequences of prompt + completion tokens
    (random, full length): the old-logprob forward (no grad) + one update (micro-batches of
    ``micro_batch``, gradient accumulation over the batch, clipping, one AdamW step, FP8 weight
    re-quantization) -- the trainer's ``_old_logprobs`` and ``_update``. One warm-up, then
    ``train_iters`` timed repeats (median). Check: every update applied (finite loss and grad).
    Target: >= 1.45x. Then the same at a smaller model's shapes (``small_train``: Qwen3-1.7B's), with
    no target: an eager FP8 linear pays its host ~1 ms per fwd+bwd whatever its size, so there the
    row shows whether FP8 training still pays (0.76-0.99x BF16 before q/k/v and gate/up trained as one
    Function, 0.93-1.13x after; 1.07-1.15x since both recipes' trainers replay the layers from CUDA graphs,
    which ``train_cuda_graphs='auto'`` does up to 3.5B parameters -- the 8B row stays eager: docs/benchmarks.md (f)).
(g) ``rl_step``: ``GRPOTrainer.train_step()`` -- rollout with the engine (``rl_prompts`` x
    ``rl_generations`` samples of ``rl_completion`` tokens, temperature 1, no EOS), the synthetic
    parity reward, old logprobs, the update. One warm-up step (graph capture, compilation),
    then ``rl_steps`` timed steps (median), for ``bf16`` and ``jet`` recomputing old logprobs, then ``jet``
    and ``jet_kv`` as shipped. Check: full-length completions, update applied. Targets: ``jet`` >= 1.25x
    (issue 5), ``jet_kv`` >= 1.5x (issue 6).
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from functools import partial
from typing import Any

import torch
from torch import nn

from jetrl.bench.checks import status
from jetrl.bench.gpu_clocks import ClockLog
from jetrl.bench.models import free_device_memory, random_model, strip_precision
from jetrl.bench.report import error_row, set_target
from jetrl.bench.shapes import BenchConfig
from jetrl.bench.synthetic import IdTokenizer, parity_reward, random_batch, random_records
from jetrl.bench.timing import allocator_mark, allocator_since, wall_s
from jetrl.rl import GRPOConfig, GRPOTrainer
from jetrl.rl.batch import RolloutBatch

TRAIN_TARGET, RL_STEP_TARGET, RL_STEP_KV_TARGET = 1.45, 1.25, 1.5  # issue 5 (f, g); issue 6 (jet_kv step)
RECIPES = ("bf16", "jet")
# (g): (recipe, old_logprobs) -- like for like (both recompute), then each recipe as shipped: ``auto``
# reuses the rollout's logprobs under the on-policy FP8 recipes (their rollout *is* the trainer's graph)
RL_STEP_CONFIGS = (("bf16", "recompute"), ("jet", "recompute"), ("jet", "auto"), ("jet_kv", "auto"))


def _trainer(model: nn.Module, recipe: str, records: list[dict], *, generations: int, batch: int,
             prompt_len: int, completion_len: int, cfg: BenchConfig, old_logprobs: str = "recompute") -> GRPOTrainer:
    args = GRPOConfig(max_steps=1_000_000, learning_rate=1e-6, num_generations=generations,
                      generation_batch_size=batch, per_device_train_batch_size=cfg.micro_batch,
                      gradient_accumulation_steps=batch // cfg.micro_batch, max_prompt_length=prompt_len,
                      max_completion_length=completion_len, old_logprobs=old_logprobs, temperature=1.0,
                      train_cuda_graphs=cfg.train_cuda_graphs)
    strip_precision(model)  # the trainer converts an unconverted model with its own recipe
    return GRPOTrainer(model, [parity_reward], args, records, tokenizer=IdTokenizer(), recipe=recipe,
                       accuracy_func=None)


def _with_trainer(rows: list[dict[str, Any]], label: str, measure: Any, model: nn.Module, recipe: str,
                  records: list[dict], **trainer_kwargs: Any) -> None:
    """Build a trainer for ``recipe`` and run ``measure(trainer)``; an exception becomes an error row
    named ``label`` (the other recipes still run). The trainer and its device memory are freed after."""
    trainer = None
    try:
        trainer = _trainer(model, recipe, records, **trainer_kwargs)
        measure(trainer)
    except Exception as exc:  # noqa: BLE001 -- recorded in the row; the other recipes still run
        rows.append(error_row(label, exc))
    finally:
        trainer = None
        free_device_memory()


def _model_note(cfg: BenchConfig, model: nn.Module) -> str:
    return f"{cfg.train_layers} layers, {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B params"


def _memory_note(memory: dict, *keys: Any) -> str:
    """'; peak GiB / allocator retries a, b' for the rows' recipes (empty off CUDA)."""
    parts = [f"{m['peak_allocated_gib']}/{m['alloc_retries']}" for m in (memory.get(k) for k in keys) if m]
    return f"; peak GiB/alloc retries {', '.join(parts)}" if parts else ""


def _comparison(name: str, unit: str, times: dict[str, float], target: float, smoke: bool,
                **extra: Any) -> dict[str, Any]:
    row = {"name": name, "unit": unit, "baseline": times.get("bf16"), "baseline_label": "bf16",
           "value": times.get("jet"), "value_label": "jet", **extra}
    row["ratio"] = times["bf16"] / times["jet"] if len(times) == 2 else None
    return set_target(row, ">=", target, smoke=smoke)


# ------------------------------------------------------------------------------------------ (f)
def _time_phase(trainer: GRPOTrainer, batch: RolloutBatch, device: torch.device) -> tuple[float, float]:
    """(old-logprob pass, update) seconds: the trainer's own two steps after a rollout."""
    metrics: dict[str, float] = {}
    t_old, _ = wall_s(partial(trainer._old_logprobs, batch, metrics), device)
    t_update, _ = wall_s(partial(trainer._update, batch, metrics), device)
    return t_old, t_update


def _phase_times(cfg: BenchConfig, device: torch.device, label: str = "training phase") -> dict[str, Any]:
    """Section (f)'s measurement at ``cfg``'s shapes: per recipe the median phase, old-logprob and update ms and the
    memory, with the error rows (named ``label`` and the recipe) and problems of a run that went wrong."""
    model = random_model(cfg.model_config(cfg.train_layers), device, torch.bfloat16)
    batch = random_batch(cfg.train_batch, cfg.train_prompt, cfg.train_completion, cfg.vocab)
    records = random_records(cfg.train_batch, cfg.train_prompt, cfg.vocab)
    out: dict[str, Any] = {"phase": {}, "old": {}, "update": {}, "memory": {}, "gpu": {}, "rows": [], "problems": []}
    for recipe in RECIPES:
        def measure(trainer: GRPOTrainer, recipe: str = recipe) -> None:
            mark = allocator_mark(device)
            with ClockLog(device) as clocks:  # large GEMMs can meet the board's power limit (gpu_clocks.py)
                # [0] is the warm-up
                samples = [_time_phase(trainer, batch, device) for _ in range(1 + cfg.train_iters)][1:]
            out["gpu"][recipe] = clocks.summary()
            out["old"][recipe] = statistics.median(s[0] for s in samples) * 1e3
            out["update"][recipe] = statistics.median(s[1] for s in samples) * 1e3
            out["phase"][recipe] = statistics.median(s[0] + s[1] for s in samples) * 1e3
            out["memory"][recipe] = allocator_since(mark, device)
            if trainer.nonfinite_steps or trainer.optimizer_steps != 1 + cfg.train_iters:
                out["problems"].append(f"{recipe}: {trainer.optimizer_steps} updates, {trainer.nonfinite_steps} non-finite")

        _with_trainer(out["rows"], f"{label} {recipe}", measure, model, recipe, records, generations=2,
                      batch=cfg.train_batch, prompt_len=cfg.train_prompt, completion_len=cfg.train_completion, cfg=cfg)
    out["model_note"] = _model_note(cfg, model)
    del model
    free_device_memory()
    return out


def _checked(row: dict[str, Any], times: dict[str, Any]) -> dict[str, Any]:
    if len(times["phase"]) == 2:
        row["check"] = status(not times["problems"])
        row["check_detail"] = "; ".join(times["problems"]) if times["problems"] else "every update applied"
    return row


def training_phase(cfg: BenchConfig, device: torch.device) -> list[dict[str, Any]]:
    times = _phase_times(cfg, device)
    phase, old, update, memory, rows = times["phase"], times["old"], times["update"], times["memory"], times["rows"]
    tokens = cfg.train_batch * (cfg.train_prompt + cfg.train_completion)
    name = f"training phase {cfg.train_batch}x{cfg.train_prompt + cfg.train_completion} tok"
    main = _comparison(name, "ms", phase, TRAIN_TARGET, cfg.smoke, tokens=tokens, old_logprobs_ms=old,
                       update_ms=update, memory=memory, gpu=times["gpu"],
                       note=times["model_note"] + "; old-logprob fwd + fwd/bwd/AdamW" + _memory_note(memory, *RECIPES))
    rows.insert(0, _checked(main, times))
    if len(phase) == 2:
        rows.append({"name": "  of which old-logprob forward", "unit": "ms", "baseline": old["bf16"],
                     "baseline_label": "bf16", "value": old["jet"], "value_label": "jet",
                     "ratio": old["bf16"] / old["jet"]})
        rows.append({"name": "  of which update (fwd+bwd+AdamW)", "unit": "ms", "baseline": update["bf16"],
                     "baseline_label": "bf16", "value": update["jet"], "value_label": "jet",
                     "ratio": update["bf16"] / update["jet"]})
    if cfg.small_train is not None:  # no target: where eager FP8 training stops paying (docs/benchmarks.md (f))
        label, fields = cfg.small_train
        layers = min(fields.get("train_layers", cfg.train_layers), cfg.train_layers)  # --train-layers caps both
        name = f"training phase, {label}" + (f", {layers} layers" if layers != fields.get("train_layers") else "")
        small = _phase_times(replace(cfg, **{**fields, "train_layers": layers}), device, name)
        row = {"name": name, "unit": "ms", "baseline": small["phase"].get("bf16"),
               "baseline_label": "bf16", "value": small["phase"].get("jet"), "value_label": "jet",
               "ratio": (small["phase"]["bf16"] / small["phase"]["jet"] if len(small["phase"]) == 2 else None),
               "old_logprobs_ms": small["old"], "update_ms": small["update"], "memory": small["memory"],
               "note": small["model_note"] + f"; no target: train_cuda_graphs={cfg.train_cuda_graphs!r} (auto: CUDA "
                       "graphs at this size, as the trainer ships), where eager FP8 would pay ~1 ms of host per linear "
                       "fwd+bwd"}
        rows.append(_checked(row, small))
        rows.extend(small["rows"])
    return rows


# ------------------------------------------------------------------------------------------ (g)
def rl_step(cfg: BenchConfig, device: torch.device) -> list[dict[str, Any]]:
    model = random_model(cfg.model_config(cfg.train_layers), device, torch.bfloat16)
    records = random_records(cfg.rl_prompts, cfg.rl_prompt, cfg.vocab, seed=2)
    num = cfg.rl_prompts * cfg.rl_generations
    step, phases, memory, gpu, rows, problems = {}, {}, {}, {}, [], []
    for recipe, old_logprobs in RL_STEP_CONFIGS:
        def measure(trainer: GRPOTrainer, key: tuple[str, str] = (recipe, old_logprobs)) -> None:
            mark = allocator_mark(device)
            with ClockLog(device) as clocks:
                samples = [wall_s(trainer.train_step, device) for _ in range(1 + cfg.rl_steps)][1:]
            gpu[key] = clocks.summary()
            step[key] = statistics.median(s for s, _ in samples)
            last = samples[-1][1]
            phases[key] = {k: last.get(k, 0.0) for k in ("time/rollout", "time/old_logprobs", "time/update")}
            memory[key] = allocator_since(mark, device)
            lengths = [m["completions/mean_length"] for _, m in samples]
            if any(n != cfg.rl_completion for n in lengths) or trainer.nonfinite_steps:
                problems.append(f"{key[0]}: mean lengths {lengths}, {trainer.nonfinite_steps} non-finite steps")

        _with_trainer(rows, f"RL step {recipe} old_logprobs={old_logprobs}", measure, model, recipe, records,
                      generations=cfg.rl_generations, batch=num, prompt_len=cfg.rl_prompt,
                      completion_len=cfg.rl_completion, cfg=cfg, old_logprobs=old_logprobs)
    base, comparisons = ("bf16", "recompute"), []
    shape = f"{num}x({cfg.rl_prompt}+{cfg.rl_completion})"
    for key, label, target in ((("jet", "recompute"), "jet (recompute old logprobs, like bf16)", RL_STEP_TARGET),
                               (("jet", "auto"), "jet as shipped (old logprobs from the rollout)", RL_STEP_TARGET),
                               (("jet_kv", "auto"), "jet_kv as shipped", RL_STEP_KV_TARGET)):
        if base not in step or key not in step:
            continue
        per_phase = "; ".join(f"{k.split('/')[1]} {phases[base][k]:.2f}/{phases[key][k]:.2f} s" for k in phases[base])
        row = {"name": f"RL step {shape} {label}", "unit": "s", "baseline": step[base], "baseline_label": "bf16",
               "value": step[key], "value_label": key[0], "ratio": step[base] / step[key],
               "phases_s": {"bf16": phases[base], key[0]: phases[key]},
               "memory": {"bf16": memory.get(base), key[0]: memory.get(key)},
               "gpu": {"bf16": gpu.get(base), key[0]: gpu.get(key)},
               "note": f"{_model_note(cfg, model)}; bf16/{key[0]} {per_phase}{_memory_note(memory, base, key)}"}
        comparisons.append(set_target(row, ">=", target, smoke=cfg.smoke))
    if comparisons:
        comparisons[0]["check"] = status(not problems)
        comparisons[0]["check_detail"] = "; ".join(problems) if problems else "full-length rollouts, updates applied"
    del model
    return rows + comparisons
