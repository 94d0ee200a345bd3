"""Teacher-forced scoring: given tokens' logprobs through the rollout engine's own forward path.

Why: the rollout reports the logprob of each token it sampled; to compare that path with the trainer's forward on
*given* tokens (:mod:`jetrl.rl.diagnose`, or to re-score completions from elsewhere) the engine must run the very
same kernels -- its prefill, its KV cache in the recipe's format, its decode attention and decode GEMMs -- with the
sampler replaced by the forced token. Per pair (prompt p, completion c):

    lp[0] = log_softmax(prefill logits at position |p| - 1 / T)[c_0]
    lp[j] = log_softmax(decode step j, fed c_{j-1} at position |p| + j - 1, / T)[c_j],   j = 1 .. |c| - 1
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from jetrl.fp8 import precision_phase

if TYPE_CHECKING:
    from jetrl.engine.engine import Engine


@torch.no_grad()
def score(engine: Engine, prompts: list[list[int]], completions: list[list[int]], temperature: float = 1.0,
          after_forward: Callable[[Tensor, Tensor], None] | None = None) -> list[Tensor]:
    """Teacher-forced rollout logprobs: ``(len(completion),)`` fp32 per pair, each completion token's logprob
    under the rollout's own forward path, at ``temperature``.

    The tokens go through exactly what ``generate`` runs, minus the sampling: the prompts prefilled (right-padded
    batches, lm_head at each prompt's last position), then one decode step per completion token over slots
    [0, B) -- the KV cache in the recipe's format, the decode attention kernel, the CUDA graphs -- feeding
    ``completions[i][j - 1]`` where the sampler's token would go. The logprob is ``log_softmax(logits / T)`` in
    fp32 by the trainer's own function (``chosen_token_logprobs``), the quantity the sampler reports for a rollout
    without top-p / top-k (its fused kernel agrees to ~1e-6; in exact mode it calls the same function) and the
    trainer recomputes; a truncated rollout reports the renormalized logprobs of its truncated distribution.
    Row ``i`` runs in slot ``i``; a row whose completion has ended keeps rewriting one unused position, as a
    frozen row does in ``generate``. Batch composition differs from the rollout that sampled the tokens
    (whose rows came and went), so on a GPU whose GEMM kernels depend on the row count the logprobs can differ
    from that rollout's in the last bits.

    ``after_forward(rows, positions)``, if given, is called after each forward: for every row of the forward's
    output, ``rows[r]`` is the pair it holds and ``positions[r, t]`` the sequence position of its ``t``-th
    column, -1 for padding. Forward hooks on the model's modules plus this map are how
    :func:`jetrl.rl.diagnose.diagnose` lines up the rollout's activations with the trainer's. With it the decode
    steps run eagerly, since hooks do not fire in a graph replay (replay equals eager bit for bit:
    tests/test_engine_graphs.py).
    """
    _check(engine, prompts, completions, temperature)
    B, dev = len(prompts), engine.device
    lengths = [len(p) for p in prompts]
    steps = max(len(c) for c in completions)
    forced = torch.zeros(B, steps, dtype=torch.int64)
    for i, c in enumerate(completions):
        forced[i, : len(c)] = torch.tensor(c)
    forced = forced.to(dev)
    logprobs = torch.zeros(B, steps, dtype=torch.float32, device=dev)

    from jetrl.rl.token_logprobs import chosen_token_logprobs  # lazy: jetrl.rl imports the engine

    def scored(logits: Tensor, step: int) -> None:
        logprobs[:, step] = chosen_token_logprobs(logits, forced[:, step], temperature)  # the trainer's arithmetic

    with precision_phase("rollout"):
        engine._ensure_state()
        if engine.use_cuda_graphs:
            engine._check_graph_weights()
        first_logits = []
        for rows in engine._pack(lengths):
            first_logits.append(engine._prefill_logits([prompts[i] for i in rows], rows))  # row i in slot i
            if after_forward is not None:
                positions = torch.full((len(rows), max(lengths[i] for i in rows)), -1, dtype=torch.int64)
                for r, i in enumerate(rows):
                    positions[r, : lengths[i]] = torch.arange(lengths[i])
                after_forward(torch.tensor(rows), positions)
        scored(torch.cat(first_logits), 0)  # chunks hold rows 0, 1, ... in order
        ends = torch.tensor([len(p) + len(c) - 1 for p, c in zip(prompts, completions)], device=dev)
        graphs = engine.use_cuda_graphs and after_forward is None  # hooks fire in an eager forward only
        for step in range(1, steps):
            engine.next_tokens[:B] = forced[:, step - 1]
            pending = engine.cache.lengths[:B].clone()
            logits = engine.graphs(B)[:B] if graphs else engine._decode_forward(B)
            if after_forward is not None:
                after_forward(torch.arange(B), torch.where(pending < ends, pending, -1).cpu()[:, None])
            scored(logits, step)
            engine.cache.lengths[:B] += engine.cache.lengths[:B] < ends  # the fed token is now cached
    return [logprobs[i, : len(c)].cpu() for i, c in enumerate(completions)]


def _check(engine: Engine, prompts: list[list[int]], completions: list[list[int]], temperature: float) -> None:
    """Refuse what ``score`` cannot run, saying what to change."""
    if len(prompts) != len(completions) or not prompts:
        raise ValueError(f"score needs one completion per prompt, got {len(prompts)} prompts and "
                         f"{len(completions)} completions")
    if len(prompts) > engine.max_slots:
        raise ValueError(f"score of {len(prompts)} pairs exceeds max_slots={engine.max_slots}; raise max_slots or "
                         "score them in batches")
    if not temperature > 0:
        raise ValueError(f"score needs a temperature > 0, got {temperature}")
    vocab, context = engine.config.vocab_size, engine.config.max_position_embeddings
    for i, (p, c) in enumerate(zip(prompts, completions)):
        if not p or not c:
            raise ValueError(f"pair {i}: prompt ({len(p)} tokens) and completion ({len(c)}) must be non-empty")
        if len(p) + len(c) > engine.max_len:
            raise ValueError(f"pair {i}: {len(p)} prompt + {len(c)} completion tokens exceed the engine's "
                             f"max_len={engine.max_len}; build the Engine with max_len >= {len(p) + len(c)}")
        ids = [*p, *c]
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"pair {i} holds token ids outside [0, {vocab}): min {min(ids)}, max {max(ids)}")
        if len(ids) - 1 > context:  # the last completion token is scored, never fed
            raise ValueError(f"pair {i}: {len(p)} prompt + {len(c)} completion tokens need {len(ids) - 1} positions, "
                             f"more than the model's context of {context} (max_position_embeddings): RoPE would "
                             "run past it and the logprobs would be garbage")
