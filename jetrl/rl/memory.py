"""Device memory running out in a phase of an RL step: an error that names the settings to lower.

Why: torch's out-of-memory message gives byte counts and allocator advice, not which of the run's
settings holds the memory. Each phase of a step has one dominant consumer:

    rollout       the engine's KV cache: generation_batch_size rows x (max_prompt_length +
                  max_completion_length) positions x layers x 2 (K, V) x kv_heads x head_dim
                  x bytes (2 in BF16; ~1 with an FP8 cache: recipe jet_kv)
    old_logprobs  one micro-batch's forward: per_device_train_batch_size sequences (or more shorter
                  ones in as many positions: micro_batches.py), their activations and their
                  (tokens, vocab) logits
    update        the same micro-batch forward + backward (activations kept for the backward),
                  next to the parameters, gradients and AdamW's two moments (4x the weights)

:class:`StepOutOfMemoryError` subclasses ``torch.OutOfMemoryError``, so code that catches torch's
error still catches it; ``jetrl train`` prints it as a one-line error. Nothing is lost: the last
checkpoint is untouched, and ``--resume`` restarts from it with the lowered settings.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from torch import nn

from jetrl.models.stacked_projections import stacked_bytes
from jetrl.rl.config import GRPOConfig

ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
EXPANDABLE_SEGMENTS = "expandable_segments:True"


def default_allocator_settings() -> str | None:
    """Give torch's CUDA caching allocator expandable segments, unless ``PYTORCH_CUDA_ALLOC_CONF`` is set (then
    nothing changes); returns the setting applied, or None. ``jetrl``'s command line calls it first thing.

    Why: a whole-model RL step on one GPU runs near its memory (the 8B on an H200 peaks at ~135 of 140 GiB,
    docs/benchmarks.md (g)), and the rollout, the old-logprob pass and the update allocate tensors of very
    different sizes in turn. With fixed segments, the blocks freed by one phase may not fit the next phase's
    requests: a run of section (g) went out of memory with 4.4 GiB reserved but free (run BV). Expandable
    segments map more memory into one growing segment instead, so freed space is reused whatever its size.
    The allocator reads the variable when CUDA initializes, so a process that has already initialized CUDA (a
    caller of ``jetrl.cli.main`` in a test) is left as it is; child processes (the bench's sections) inherit it.
    """
    if ALLOC_CONF in os.environ or torch.cuda.is_initialized():
        return None
    os.environ[ALLOC_CONF] = EXPANDABLE_SEGMENTS
    return EXPANDABLE_SEGMENTS


class StepOutOfMemoryError(torch.OutOfMemoryError):
    """A phase of an RL step ran out of device memory; the message names the settings to lower."""


def advice(phase: str, args: GRPOConfig, stacked_bytes: int = 0, train_graphs: bool = False) -> str:
    """What to lower when ``phase`` ("rollout", "old_logprobs" or "update") runs out of memory; ``stacked_bytes``:
    what the BF16 sibling stacks hold (jetrl/models/stacked_projections.py); ``train_graphs``: whether the trainer's
    CUDA graphs hold their memory (jetrl/rl/train_graphs.py)."""
    context = args.max_prompt_length + args.max_completion_length
    if phase == "rollout":
        text = (f"the engine's KV cache holds generation_batch_size={args.generation_batch_size} rows of up to "
                f"{context} positions: lower grpo.generation_batch_size or grpo.max_completion_length, or use the "
                "recipe jet_kv (an FP8 cache, about half the bytes)")
    else:
        text = (f"each micro-batch holds per_device_train_batch_size={args.per_device_train_batch_size} sequences of "
                f"up to {context} tokens, or more shorter ones in as many positions and logit rows (activations and "
                "their vocabulary-wide logits; jetrl/rl/micro_batches.py): lower "
                "grpo.per_device_train_batch_size and raise grpo.gradient_accumulation_steps by the same factor (the "
                "batch per update stays the same)")
    if stacked_bytes:
        text += (f"; the BF16 rollout's stacked q/k/v and gate/up weights hold {stacked_bytes / 2**30:.1f} GiB: "
                 "JETRL_BF16_STACKS=0 runs them as separate GEMMs without that copy")
    if train_graphs:
        text += ("; the trainer's CUDA graphs hold a micro-batch's activations, each captured shape's input and "
                 "output, and the layers' gradients between updates: grpo.train_cuda_graphs='off' gives that memory "
                 "back to every phase")
    return text


@contextlib.contextmanager
def oom_advice(phase: str, args: GRPOConfig, step: int, model: nn.Module | None = None,
               train_graphs: bool = False) -> Iterator[None]:
    """Re-raise a ``torch.OutOfMemoryError`` inside the block as a :class:`StepOutOfMemoryError` with advice
    (``model``: to tell what its BF16 sibling stacks hold; ``train_graphs``: see :func:`advice`)."""
    try:
        yield
    except StepOutOfMemoryError:
        raise
    except torch.OutOfMemoryError as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else "out of memory"
        raise StepOutOfMemoryError(
            f"step {step}: the {phase} phase ran out of device memory ({first_line}); "
            f"{advice(phase, args, stacked_bytes(model) if model is not None else 0, train_graphs)}; "
            "then resume from the last checkpoint (jetrl train --run-dir DIR --resume)") from exc
