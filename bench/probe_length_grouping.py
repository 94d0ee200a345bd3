"""The training phase on completions of spread lengths: micro-batches in rollout order, grouped by length, packed.

Bench (f) trains full-length sequences, where every micro-batch is as long as the others and grouping changes
nothing. A real rollout's completions stop anywhere up to ``max_completion_length``. This runs (f)'s own code (the
trainer's ``_old_logprobs`` + ``_update``, jetrl/bench/training.py) on a batch of ``ROWS`` sequences, a
``PROMPT``-token prompt each and completions whose lengths are spread evenly over [``MIN``, ``MAX``] in a shuffled
order, under ``bf16`` and ``jet`` (one process), in three arms (jetrl/rl/micro_batches.py): ``plain``
(``grpo.group_by_length=false``), ``grouped`` (sorted, ``size`` rows per micro-batch: the trainer's rule with
CUDA-graphed layers) and ``packed`` (sorted and packed: its rule for eager layers), timed in the order plain,
grouped, packed, packed, grouped, plain after one warm-up each (a drift cancels to first order). Reported: the
phase's ms, the micro-batches and positions each arm computes, and how far the arms' old logprobs differ from
plain's on the GPU (its GEMMs are not batch-invariant: a row's neighbours may change its bits).

    PYTHONPATH=. OUT=$OUT python3 bench/probe_length_grouping.py      # ROWS=64 MICRO=8 PROMPT=128 MIN=64 MAX=1024
    SIZE=1.7b PYTHONPATH=. OUT=$OUT python3 bench/probe_length_grouping.py   # Qwen3-1.7B's shapes: CUDA-graphed layers
    SMOKE=1 DEVICE=cpu LAYERS=2 ROWS=16 MICRO=4 MIN=4 MAX=64 PYTHONPATH=. python3 bench/probe_length_grouping.py  # tiny
"""

import contextlib
import json
import os
import statistics
import unittest.mock
from dataclasses import replace

import torch

import jetrl.rl.trainer as trainer_module
from jetrl.bench.models import free_device_memory, random_model
from jetrl.bench.shapes import QWEN3_SHAPES, h200_config, smoke_config
from jetrl.bench.synthetic import batch_of_lengths, random_records
from jetrl.bench.training import _time_phase, _trainer
from jetrl.rl.batch import RolloutBatch
from jetrl.rl.micro_batches import padded_positions, plan


def _env(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def spread_batch(rows: int, prompt: int, low: int, high: int, vocab: int) -> RolloutBatch:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.linspace(low, high, rows).round().long()[torch.randperm(rows, generator=gen)].tolist()
    return batch_of_lengths(lengths, prompt, vocab, gen)


ARMS = ("plain", "grouped", "packed")


def _arm(trainer, arm: str):
    """Set ``trainer`` up for ``arm``; returns the context that holds it (grouped: packing off)."""
    trainer.args.group_by_length = arm != "plain"
    if arm != "grouped":
        return contextlib.nullcontext()
    return unittest.mock.patch.object(trainer_module, "plan", lambda *a, **k: plan(*a, **{**k, "pack": False}))


def main() -> None:
    device = torch.device(os.environ.get("DEVICE", "cuda"))
    rows, micro, prompt = _env("ROWS", 64), _env("MICRO", 8), _env("PROMPT", 128)
    low, high = _env("MIN", 64), _env("MAX", 1024)
    shapes = smoke_config if os.environ.get("SMOKE") == "1" else h200_config
    cfg = replace(shapes(micro_batch=micro), train_batch=rows, train_iters=1)
    if "SIZE" in os.environ:  # a smaller Qwen3's shapes, whose trainers replay CUDA graphs ('auto' up to 3.5B)
        cfg = replace(cfg, **QWEN3_SHAPES[os.environ["SIZE"]])
    cfg = replace(cfg, train_layers=_env("LAYERS", cfg.train_layers))
    batch = spread_batch(rows, prompt, low, high, cfg.vocab)
    lengths = batch.prompt_lengths + batch.completion_lengths
    accum = rows // micro
    completions = batch.completion_lengths
    plans = {"plain": plan(lengths, completions, micro, accum, False),
             "grouped": plan(lengths, completions, micro, accum, True),
             "packed": plan(lengths, completions, micro, accum, True, pack=True)}
    shape = {arm: {"micro_batches": sum(len(step) for step in p),
                   "positions": padded_positions(lengths, [mb for step in p for mb in step])}
             for arm, p in plans.items()}
    model = random_model(cfg.model_config(cfg.train_layers), device, torch.bfloat16)
    records = random_records(rows, prompt, cfg.vocab)
    results: dict = {"rows": rows, "micro_batch": micro, "prompt": prompt, "completion": [low, high],
                     "layers": cfg.train_layers, "size": os.environ.get("SIZE", "8b"),
                     "real_tokens": int(lengths.sum()),
                     "update_plans": shape, "torch": torch.__version__,
                     "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    for recipe in ("bf16", "jet"):
        trainer = _trainer(model, recipe, records, generations=2, batch=rows, prompt_len=prompt,
                           completion_len=high, cfg=cfg)
        old: dict[str, torch.Tensor] = {}
        for arm in ARMS:  # the same weights: each update below moves them
            with _arm(trainer, arm):
                trainer._old_logprobs(batch, {})
            old[arm] = batch.old_logprobs * batch.token_mask()
        times: dict[str, list[float]] = {arm: [] for arm in ARMS}
        for arm in (*ARMS, *ARMS, *ARMS[::-1]):  # the first three warm up each arm's shapes
            with _arm(trainer, arm):
                t_old, t_update = _time_phase(trainer, batch, device)
            times[arm].append((t_old + t_update) * 1e3)
        results[recipe] = {
            **{f"{arm}_ms": statistics.median(times[arm][1:]) for arm in ARMS}, "samples": times,
            **{f"old_logprob_max_abs_diff_{arm}": float((old[arm] - old["plain"]).abs().max()) for arm in ARMS[1:]},
            "updates": f"{trainer.optimizer_steps} updates, {trainer.nonfinite_steps} non-finite",
            "graph_captures": None if trainer.train_graphs is None else trainer.train_graphs.num_captures}
        trainer = None
        free_device_memory()
    del model
    name = f"probe_length_grouping_{os.environ.get('SIZE', '8b')}.json"
    with open(os.path.join(os.environ.get("OUT", "."), name), "w") as f:
        json.dump(results, f, indent=1)
    print(json.dumps(results, indent=1))
    print(f"\n{rows} rows x ({prompt} + {low}-{high}) tokens, micro-batches of {micro}, {cfg.train_layers} layers, "
          f"{int(lengths.sum())} real tokens; update micro-batches / positions: "
          + ", ".join(f"{arm} {shape[arm]['micro_batches']} / {shape[arm]['positions']}" for arm in ARMS))
    print(f"{'recipe':8} " + " ".join(f"{arm + ' ms':>11}" for arm in ARMS) + "  speed-ups vs plain  old-lp max diff")
    for recipe in ("bf16", "jet"):
        r = results[recipe]
        print(f"{recipe:8} " + " ".join(f"{r[arm + '_ms']:11.1f}" for arm in ARMS) + "  "
              + " / ".join(f"{r['plain_ms'] / r[arm + '_ms']:.2f}" for arm in ARMS[1:])
              + "  " + " / ".join(f"{r['old_logprob_max_abs_diff_' + arm]:.1e}" for arm in ARMS[1:])
              + f"  ({r['updates']}; graph captures {r['graph_captures']})")
    print("jet vs bf16: " + ", ".join(f"{arm} {results['bf16'][arm + '_ms'] / results['jet'][arm + '_ms']:.2f}x"
                                      for arm in ARMS))


if __name__ == "__main__":
    main()
