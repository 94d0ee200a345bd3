"""Bit-reproducible runs on a GPU: ``jetrl train`` with ``deterministic=true``, the default.

Why: on the CPU a run is a function of its config and seed (everything random derives from ``(seed, step)``), and a
killed run resumes bit for bit. On CUDA, without this setting, it is not: some of torch's kernels reduce in an order
that varies from run to run. Measured on an H200 with the embedded default (`jetrl train`, 60 RL steps,
docs/benchmarks.md runs FM-FQ): four runs of the same command first differed at step 2 to 19 and ended at held-out
0.875-0.94 -- with the weight refresh eager or from its graph alike. With torch's deterministic algorithms and a fixed
cuBLAS workspace, two runs were bit-identical in every metric of all 60 steps; the fixed cuBLAS workspace alone was
not enough.

What it sets, for the run: ``torch.use_deterministic_algorithms(True, warn_only=True)`` -- an op with no deterministic
implementation warns, naming itself, instead of stopping the run -- and ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` where it
is unset. cuBLAS reads that variable when it starts, so it is set before the run touches CUDA; a process whose cuBLAS
already started keeps its workspace, and a warning says so. The previous torch settings are restored afterwards.

Which op it was (bench/probe_nondeterminism.py, run FR): in the embedded default (fp32 master weights, the training
layers replayed from CUDA graphs) repeated backward passes from the same weights gave the same gradient for every
parameter but one, the token embedding's (off by up to 6e-9). With the layers eager, at the unpadded length, it
repeated too: the varying kernel is the embedding's CUDA backward over the graphs' padded token ids (most of them the
padding's token 0), which deterministic mode replaces. Rollouts and the old-logprob pass repeated bit for bit either
way, and with BF16 master weights every gradient repeated over 4 passes in default mode too (run FS; attention pinned
to flash, cuDNN or math alike).

What it leaves off: torch's deterministic mode also fills every new ``torch.empty`` tensor with NaN
(``torch.utils.deterministic.fill_uninitialized_memory``), one extra kernel per allocation, so that a kernel reading
memory it never wrote reads the same thing each run. That fill was the whole cost: with it the 8B training phase
(bench (f)) took 8-10% longer under ``jet`` and 3% under ``bf16``, Qwen3-1.7B's 10-15% and 5-7% (runs FR, FS);
without it -0.2% / +0.5% and +1.9% / 0% (run FS), within the noise, and one 8B RL step (bench (g), run FT) +0.5%
under ``bf16``, +0.5-0.7% under ``jet``, +1.9% under ``jet_kv``. jetrl's kernels are written to read only what they
wrote; two 60-step runs of the embedded default without the fill were still bit-identical (run FS; a kernel reading
stale memory would have shown as a difference), so the fill is off for the run. At that cost the setting is on by
default; ``deterministic=false`` lets torch pick its nondeterministic kernels.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator

import torch
import torch.utils.deterministic

CUBLAS_ENV = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_FIXED_WORKSPACE = ":4096:8"


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool = True) -> Iterator[None]:
    """Run the block with torch's deterministic algorithms, a fixed cuBLAS workspace and no fill of new tensors (module
    docstring); a no-op when ``enabled`` is False."""
    if not enabled:
        yield
        return
    if CUBLAS_ENV not in os.environ:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            warnings.warn(f"deterministic=true: CUDA already started in this process without {CUBLAS_ENV}, so cuBLAS "
                          f"may still reduce nondeterministically; set {CUBLAS_ENV}={CUBLAS_FIXED_WORKSPACE} before "
                          "the process starts", stacklevel=3)
        os.environ[CUBLAS_ENV] = CUBLAS_FIXED_WORKSPACE
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False  # (module docstring: what it leaves off)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.utils.deterministic.fill_uninitialized_memory = fill
