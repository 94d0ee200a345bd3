"""Exact mode: batch-invariant kernels on the GPU, so the rollout's logprobs equal the trainer's bit for bit.

Why: the rollout engine computes a token's logprob in a decode step (M = batch rows per GEMM, one query
per row in attention); the trainer recomputes it in a full forward (M = every token of a micro-batch).
On CPU jetrl is exact already (fp64 GEMM emulation and attention, tests/test_engine.py). On a GPU the
fast kernels pick their tiling by the problem size -- cuBLAS's heuristics, split-K, the decode
attention's split count -- so a row's sums run in another order in the two passes, round differently,
and the FP8 re-quantization of the next layer's input turns those ulps into whole code flips
(docs/benchmarks.md: `jetrl diagnose` on the H200, where `jet`'s decode gap is as large as the
off-policy `fp8kv_rollout`'s). Exact mode removes that source: a row's result depends on the
arithmetic applied to that row only, which is fixed per kernel.

What it changes, on CUDA (on the CPU: fp32 ``F.linear`` -- the lm_head, BF16 recipes' projections -- accumulates
in fp64 like the FP8 emulation, and the last item):

* FP8 forward GEMMs: on Hopper, for a layer whose K is a multiple of 256, the Gluon kernel of the fast path, whose
  bits do not depend on its tiles (measured at every M and tile: fp8/gemm.py ``_gemm_exact``), at the fastest tile
  per shape; for any other layer or GPU one Triton kernel with one tile shape and one cut of K into runs per layer,
  for every M (fp8/kernels/gemm_exact_triton.py). The choice is the layer's, never M's;
* ``F.linear`` in high precision (the lm_head in every recipe, the BF16 recipes' projections, the BF16
  sibling stacks): a Triton GEMM built as the Triton FP8 one (models/kernels/exact_linear_triton.py). In both, a
  decode step's narrow layers run each K run as its own program and add the runs in order at the end, the trainer's
  thousands of rows one program per tile adding them in registers: the same additions (fp8/kernels/split_k.py);
* ``F.scaled_dot_product_attention`` (the trainer's forward, the prefill) and the decode's attention over the
  KV cache (instead of the fused decode kernel; an FP8 cache's codes and scales read directly): one Triton kernel
  with one tile shape and one binary (models/kernels/exact_attention_triton.py);
* the engine reports each sampled token's logprob with the trainer's own function
  (``jetrl.rl.token_logprobs.chosen_token_logprobs``) instead of the sampler's own reduction -- on the CPU
  too, where that is the only change (the sampler's log-softmax agrees with the trainer's to ~1e-6 only).

Everything else in the forward is batch-invariant already: RMSNorm (its tiles follow the row width),
RoPE, SwiGLU, the quantizers (per 128-group / per token-head) and the K/V store. The two model ops are
replaced through a ``TorchFunctionMode`` while :func:`use_exact` is active, so the model code is not
touched; the backward is unchanged in spirit (BF16 GEMMs for the linear layer's gradients, SDPA's
gradient for attention), since gradients never reach a rollout.

Cost (H200, docs/benchmarks.md "Exact mode", run DI): 1.6-1.7x the trainer's forward, 1.1-1.3x the decode step at
64 rows and 1.4-1.7x at 256, 1.15-1.34x a whole RL step of an 8B model (``jet`` least, ``bf16`` most) -- the decode's
attention runs 16-row tiles of which a step fills 4, bound by each row's chain of per-tile instructions rather than
the cache's bytes, and the BF16 linear layer (the lm_head) is a fixed-tile Triton GEMM.
So exact mode is for measuring and for runs that want zero mismatch, and off by default. It needs an SM89+ GPU with
Triton and the fused kernels on.

Use: ``with jetrl.exact.use_exact(): ...`` around both the trainer and the engine, in the thread that runs them
(the switch is process-wide, the interception of the two model ops per thread), ``exact: true`` in a run config,
``--exact`` on ``jetrl diagnose``, or ``JETRL_EXACT=1`` for any ``jetrl`` command.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from jetrl.overrides import ScopedOverride, env_choice

ENV = "JETRL_EXACT"
_override = ScopedOverride("exact-mode setting", (True, False))


def exact_requested() -> bool:
    """True inside ``use_exact(True)`` (and not inside a nested ``use_exact(False)``)."""
    return _override.value is True


def exact_active(device: torch.device | str) -> bool:
    """True if work on ``device`` runs the batch-invariant kernels: exact mode is on and ``device`` is CUDA."""
    return _override.value is True and torch.device(device).type == "cuda"


def exact_from_env() -> bool:
    """``JETRL_EXACT`` as the ``jetrl`` commands read it: 1 turns exact mode on."""
    return env_choice(ENV, ("0", "1"), "1 = batch-invariant GPU kernels, rollout logprobs equal the trainer's") == "1"


@contextlib.contextmanager
def use_exact(enabled: bool = True) -> Iterator[None]:
    """Exact mode on (or, nested, off) inside the block (module docstring: enter it in the thread that runs the
    trainer and the engine)."""
    with _override(bool(enabled)):
        if not enabled:
            yield
            return
        with _ExactOps():
            yield


class _ExactOps(TorchFunctionMode):
    """Sends CUDA ``F.linear`` and ``F.scaled_dot_product_attention`` calls to the batch-invariant kernels while
    exact mode is on; every other call passes through unchanged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _override.value is True and (func is F.linear or func is F.scaled_dot_product_attention):
            first = args[0] if args else kwargs.get("input", kwargs.get("query"))
            if isinstance(first, torch.Tensor) and first.is_cuda:
                from jetrl.models import exact_ops  # lazy: Triton

                op = exact_ops.exact_linear if func is F.linear else exact_ops.exact_attention
                return op(*args, **kwargs)
            if isinstance(first, torch.Tensor) and func is F.linear and first.dtype == torch.float32:
                return _linear_fp64(*args, **kwargs)
        return func(*args, **kwargs)


def _linear_fp64(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A CPU fp32 linear layer accumulated in fp64 and rounded once: every product of two fp32 values is exact in
    fp64 and the sum's error is far below an fp32 ulp, so the result is (but for near-ties) the correctly rounded
    dot product whatever order the BLAS sums in -- batch-invariant, as the FP8 GEMM emulation (fp8/gemm.py)."""
    return F.linear(input.double(), weight.double(), None if bias is None else bias.double()).to(input.dtype)
