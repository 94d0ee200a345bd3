"""Micro-batches of a rollout batch: which rows share a forward, and which forwards share an optimizer step.

Why: a micro-batch runs at the length of its longest row (``RolloutBatch.select`` trims it to that), so every
shorter row in it is padding the GPU computes anyway. RL completions spread widely -- a math rollout stops anywhere
from a few dozen tokens to ``max_completion_length`` -- and micro-batches taken in rollout order are each about as
long as the longest rows. With lengths spread evenly over [0, L], a micro-batch of b rows in rollout order computes
b * L * b / (b + 1) positions for b * L / 2 real tokens, ~2x the work at b = 16; sorted, each micro-batch spans
~1/n of the range, and the positions computed are the real tokens plus ~b * L / 2 per optimizer step of n
micro-batches. Grouping rows of similar length is HF ``TrainingArguments.group_by_length``; verl reaches the same
end by packing (``use_remove_padding``) and token budgets (``use_dynamic_bsz``). Measured on the H200 (run GO,
bench/probe_length_grouping.py: 64 rows of 128 + 64-1024 tokens, micro-batches of 8): 32% fewer positions, the
training phase (old-logprob pass + update) of the 8B 1.38x faster under ``bf16`` and 1.41x under ``jet``; at
Qwen3-1.7B's shapes, CUDA-graphed, 1.32x and 1.29-1.33x.

The rule (:func:`plan`, ``grpo.group_by_length``, on by default):

    optimizer steps   the rows in rollout order, cut into runs of ``size * accum`` -- exactly as without grouping,
                      so every optimizer step sees the same rows (the same prompts' groups): grouping never moves a
                      row into another step, which would change what each step learns;
    micro-batches     within one optimizer step, its rows sorted by length (prompt + completion; longest first,
                      ties in rollout order), cut into runs of ``size``: the longest rows run first.
    packing           (``pack``: the trainer's layers run eagerly) the sorted rows are cut into the fewest
                      micro-batches that each fit in ``size`` x the step's longest row positions (activations) and
                      ``size`` x its longest completion logits (the LM head's, vocabulary-wide) -- the most a
                      micro-batch of ``size`` rows in rollout order may hold, so packing never needs more memory
                      -- and, of those cuts, the one with the fewest positions: a micro-batch of short rows holds
                      more of them (verl's ``use_dynamic_bsz``, with budgets the step itself sets).
                      Why: an eager FP8 layer costs the host ~1 ms per forward+backward whatever its rows
                      (docs/benchmarks.md (b)), so fewer micro-batches cost the host less; each is a little wider,
                      so the GPU computes a few more positions. On the H200 at 8B (run GO, 64 rows of 128 + 64-1024
                      tokens): 6 micro-batches instead of 8, 3% more positions, ``jet`` 2% faster than grouping
                      alone and ``bf16`` 0.6% slower. With CUDA-graphed layers (train_graphs.py) a micro-batch costs
                      the host one replay and a new shape is a capture: there every micro-batch keeps ``size``
                      rows, so the shapes stay (rows, length bucket).

What it changes in the update: for ``dapo``, ``grpo`` and ``dr_grpo`` each micro-batch's loss is a sum of per-token
or per-sequence terms whose weights come from the whole optimizer step's counts (``trainer._micro_batch_weight``:
a micro-batch of any number of rows weighs its sequences or tokens by the step's totals),
so grouping changes only the order of the sum -- and, in the FP8 wgrad, which tokens share a 1x128 group along
tokens (padding positions join those groups either way). ``bnpo`` divides each micro-batch's loss by its own
token count, so which rows share a micro-batch is part of its loss: under ``bnpo`` the update keeps rollout order.

The old-logprob pass (and the reference model's) runs the update's own micro-batches, one optimizer step's after
another, and puts the results back in rollout order: the first pass of the update then repeats its forwards exactly,
so its ratios start at 1 wherever the kernels are deterministic. With the emulated FP8 GEMMs (CPU) a row's logprobs
do not depend on the rows beside it, so there they are bit-identical to rollout order's (a test); on the H200 they
were too in runs GO and GP.

Data parallel: each rank groups its own rows. A two-rank run then sums its gradient in another order than one
process over the same rows, so runs are bit-identical across rank counts only with ``group_by_length=false``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def length_order(lengths: Tensor) -> Tensor:
    """Indices that sort ``lengths`` longest first; ties keep their order."""
    return torch.sort(lengths, descending=True, stable=True).indices


def plan(lengths: Tensor, completion_lengths: Tensor, size: int, accum: int, group_by_length: bool,
         pack: bool = False) -> list[list[Tensor]]:
    """The update's optimizer steps over rows with these ``lengths`` (prompt + completion) and
    ``completion_lengths``: per step, its micro-batches as index tensors (module docstring): ``size`` rows each (the
    last may be short), or packed within the positions and the logits of the step's longest micro-batch."""
    steps = []
    for start in range(0, len(lengths), size * accum):
        rows = torch.arange(start, min(start + size * accum, len(lengths)))
        if group_by_length:
            rows = rows[length_order(lengths[rows])]
        steps.append(_packed(rows, lengths, completion_lengths, size) if group_by_length and pack
                     else list(rows.split(size)))
    return steps


def _packed(rows: Tensor, lengths: Tensor, completion_lengths: Tensor, size: int) -> list[Tensor]:
    """``rows`` (longest first) cut into the fewest micro-batches that each fit in ``size`` x the longest row's
    positions and in ``size`` x the longest completion's logits -- what some micro-batch of ``size`` rows in rollout
    order may hold -- and, of those cuts, the one that computes the fewest positions.

    Dynamic programming over the sorted rows: ``best[i]`` is the best cut of ``rows[:i]`` as (micro-batches,
    positions, where its last micro-batch starts); the last micro-batch ``rows[j:i]`` holds (i - j) x length[j]
    positions and (i - j) x its longest completion logits, both growing as j falls, so the search for each i stops
    at the first j over a budget (j = i - 1, one row, never is). O(rows x rows per micro-batch).
    """
    by_row, completions = lengths[rows].tolist(), completion_lengths[rows].tolist()
    budget, logits_budget = size * by_row[0], size * max(completions)
    best: list[tuple[int, int, int]] = [(0, 0, 0)]
    for i in range(1, len(by_row) + 1):
        choice, longest_completion = None, 0
        for j in range(i - 1, -1, -1):
            longest_completion = max(longest_completion, completions[j])
            if (i - j) * by_row[j] > budget or (i - j) * longest_completion > logits_budget:
                break
            count, positions, _ = best[j]
            candidate = (count + 1, positions + (i - j) * by_row[j], j)
            choice = candidate if choice is None else min(choice, candidate)
        best.append(choice)
    cuts, end = [], len(by_row)
    while end:
        start = best[end][2]
        cuts.append(rows[start:end])
        end = start
    return cuts[::-1]


def padded_positions(lengths: Tensor, micro_batches: list[Tensor]) -> int:
    """Positions the micro-batches compute: each runs its rows at its longest row's length."""
    return sum(len(mb) * int(lengths[mb].max()) for mb in micro_batches if len(mb))
