"""CUDA-graphed training under dynamic sampling: a short micro-batch captured at its own row count, or padded to
the full micro-batch's rows (``TrainingGraphs(row_multiple=...)``, ``grpo.train_graph_row_multiple``).

DAPO's dynamic sampling drops the groups whose rewards all agree, so each RL step trains a different number of rows
and its last micro-batch is short by a different amount. With CUDA-graphed layers (jetrl/rl/train_graphs.py) every
new (rows, length) shape is a capture -- two eager warm-ups and a recorded pass, once for the update and once for
the old-logprob pass -- and past 16 shapes the least recently used one is dropped and captured again later. Padding
the short micro-batch's rows up to the full one's replays a graph the step already needs, at the cost of computing
the padding rows.

This runs the trainer's own old-logprob pass and update (jetrl/bench/training.py's ``_time_phase``) over ``STEPS``
batches whose row counts cycle through ``ROW_COUNTS`` (multiples of the group size, as dynamic sampling leaves them),
with a ``PROMPT``-token prompt and completions of random lengths in [``MIN``, ``MAX``], under ``bf16`` and ``jet``
(one process, Qwen3-1.7B's shapes by default: CUDA graphs are on up to 3.5B), old logprobs recomputed
(``OLD_LOGPROBS=rollout``: reused from the rollout, as ``jet`` does by default, so no no-grad shapes). Each arm
starts with no graph held and runs two sequences: ``cold`` (the first steps of a run: every new shape a capture)
and then ``steady``, ``STEPS`` new
batches (other lengths, the row counts rotated) with the cold sequence's graphs still held, so its captures are the
ones a long run keeps paying. One step runs first, untimed, with graphs that are then dropped (the process's own
first-call costs: kernel compilation, allocator growth); arms run in their order and then in reverse (a drift
cancels to first order). Each arm captures a shape at its first use; ``USES=1,2`` adds arms that capture it at its
second (``TrainingGraphs(capture_on_use=2)``, the default since run GX), the first running eagerly.
Reported per sequence: ms, captures, eager calls, and the positions the update computes (padding rows included).

    PYTHONPATH=. OUT=$OUT python3 bench/probe_graph_rows.py        # SIZE=1.7b MICRO=16 ROW_COUNTS=56,40,48,24,...
    SMOKE=1 MICRO=4 ROW_COUNTS=6,8,2 PROMPT=8 MIN=4 MAX=16 PYTHONPATH=. python3 bench/probe_graph_rows.py  # CUDA
"""

import json
import os
import statistics
import time
from dataclasses import replace

import torch

from jetrl.bench.models import free_device_memory, random_model
from jetrl.bench.shapes import QWEN3_SHAPES, h200_config, smoke_config
from jetrl.bench.synthetic import batch_of_lengths, random_records
from jetrl.bench.training import _time_phase, _trainer
from jetrl.rl.batch import RolloutBatch
from jetrl.rl.micro_batches import plan
from jetrl.rl.train_graphs import TrainingGraphs


def _env(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def step_batch(rows: int, prompt: int, low: int, high: int, vocab: int, seed: int) -> RolloutBatch:
    gen = torch.Generator().manual_seed(seed)
    return batch_of_lengths(torch.randint(low, high + 1, (rows,), generator=gen).tolist(), prompt, vocab, gen, seed)


def positions(batches: list[RolloutBatch], size: int, accum: int, graphs: TrainingGraphs) -> int:
    """Positions the update's layers compute over the sequence, at the graphs' padded shapes."""
    total = 0
    for batch in batches:
        lengths = batch.prompt_lengths + batch.completion_lengths
        for step in plan(lengths, batch.completion_lengths, size, accum, True):
            total += sum(graphs.padded_rows(len(mb)) * graphs.padded_length(int(lengths[mb].max())) for mb in step)
    return total


def main() -> None:
    device = torch.device("cuda")
    micro, prompt, low, high = _env("MICRO", 16), _env("PROMPT", 128), _env("MIN", 64), _env("MAX", 1024)
    counts = [int(n) for n in os.environ.get("ROW_COUNTS", "56,40,48,24,64,32,56,40").split(",")]
    steps = _env("STEPS", len(counts))
    smoke = os.environ.get("SMOKE") == "1"
    cfg = replace((smoke_config if smoke else h200_config)(micro_batch=micro), train_iters=1)
    if not smoke:
        cfg = replace(cfg, **QWEN3_SHAPES[os.environ.get("SIZE", "1.7b")])
    cfg = replace(cfg, train_layers=_env("LAYERS", cfg.train_layers), train_cuda_graphs="on")
    widest = max(counts)
    sequences = {"cold": [step_batch(counts[i % len(counts)], prompt, low, high, cfg.vocab, seed=i)
                          for i in range(steps)],
                 "steady": [step_batch(counts[(i + 3) % len(counts)], prompt, low, high, cfg.vocab, seed=steps + i)
                            for i in range(steps)]}
    model = random_model(cfg.model_config(cfg.train_layers), device, torch.bfloat16)
    records = random_records(widest, prompt, cfg.vocab)
    old_logprobs = os.environ.get("OLD_LOGPROBS", "recompute")
    results: dict = {"row_counts": {name: [len(b.prompt_lengths) for b in batches]
                                    for name, batches in sequences.items()}, "micro_batch": micro, "prompt": prompt,
                     "completion": [low, high], "layers": cfg.train_layers, "old_logprobs": old_logprobs,
                     "size": "smoke" if smoke else os.environ.get("SIZE", "1.7b"),
                     "torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    # arm -> (row_multiple, capture_on_use); USES=1,2 adds the arms that capture a shape on its second use
    uses = [int(u) for u in os.environ.get("USES", "1").split(",")]
    arms = {f"{rows}{'' if use == 1 else f'_use{use}'}": (multiple_rows, use)
            for rows, multiple_rows in (("own_rows", 1), ("padded_rows", micro)) for use in uses}
    for recipe in ("bf16", "jet"):
        trainer = _trainer(model, recipe, records, generations=2, batch=widest, prompt_len=prompt,
                           completion_len=high, cfg=cfg, old_logprobs=old_logprobs)
        multiple, accum = trainer.train_graphs.length_multiple, trainer.args.gradient_accumulation_steps
        trainer.train_graphs = TrainingGraphs(model, multiple, capture_on_use=1)  # every shape of it captured:
        _time_phase(trainer, sequences["cold"][0], device)  # the process's first-call costs, in no arm
        times = {(name, arm): [] for name in sequences for arm in arms}
        captures = {(name, arm): [] for name in sequences for arm in arms}
        eager = {(name, arm): [] for name in sequences for arm in arms}
        for arm in [*arms, *reversed(arms)]:  # a drift cancels to first order
            trainer.train_graphs.reset()
            trainer.train_graphs = TrainingGraphs(model, multiple, row_multiple=arms[arm][0],
                                                  capture_on_use=arms[arm][1])
            for name, batches in sequences.items():
                held, ran = trainer.train_graphs.num_captures, trainer.train_graphs.num_eager
                torch.cuda.synchronize()
                start = time.perf_counter()
                for batch in batches:
                    _time_phase(trainer, batch, device)
                times[name, arm].append((time.perf_counter() - start) * 1e3)
                captures[name, arm].append(trainer.train_graphs.num_captures - held)
                eager[name, arm].append(trainer.train_graphs.num_eager - ran)
        results[recipe] = {
            f"{name}_{arm}": {"ms": statistics.mean(times[name, arm]), "samples_ms": times[name, arm],
                              "captures": captures[name, arm], "eager_calls": eager[name, arm],
                              "positions": positions(sequences[name], micro, accum,
                                                     TrainingGraphs(model, multiple, row_multiple=arms[arm][0]))}
            for name in sequences for arm in arms}
        results[recipe].update(length_multiple=multiple,
                               updates=f"{trainer.optimizer_steps} updates, {trainer.nonfinite_steps} non-finite")
        trainer.train_graphs.reset()
        trainer = None
        free_device_memory()
    with open(os.path.join(os.environ.get("OUT", "."), "probe_graph_rows.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(json.dumps(results, indent=1))
    print(f"\n{steps} steps of {results['row_counts']} rows x ({prompt} + {low}-{high}) tokens, micro-batches of "
          f"{micro}, {cfg.train_layers} layers")
    print(f"{'recipe':8} {'sequence':8} {'arm':20} {'ms':>7} {'speed-up':>9}  captures  eager calls  positions")
    for recipe in ("bf16", "jet"):
        for name in sequences:
            base = results[recipe][f"{name}_{next(iter(arms))}"]["ms"]
            for arm in arms:
                row = results[recipe][f"{name}_{arm}"]
                print(f"{recipe:8} {name:8} {arm:20} {row['ms']:7.0f} {base / row['ms']:9.2f}  {row['captures']}  "
                      f"{row['eager_calls']}  {row['positions']}")


if __name__ == "__main__":
    main()
