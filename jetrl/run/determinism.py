"""Bit-reproducible runs on a GPU: ``jetrl train deterministic=true``.

Why: on the CPU a run is a function of its config and seed (everything random derives from ``(seed, step)``), and a
killed run resumes bit for bit. On CUDA, by default, it is not: some of torch's kernels reduce in an order that varies
from run to run (atomic additions; attention's backward is the usual one). Measured on an H200 with the embedded
default (`jetrl train`, 60 RL steps, docs/benchmarks.md runs FM-FQ): four runs of the same command first differed at
step 2 to 19 and ended at held-out 0.875-0.94 -- with the weight refresh eager or from its graph alike. With torch's
deterministic algorithms and a fixed cuBLAS workspace, two runs were bit-identical in every metric of all 60 steps,
and no slower at that size; the fixed cuBLAS workspace alone was not enough.

What it sets, for the run: ``torch.use_deterministic_algorithms(True, warn_only=True)`` -- an op with no deterministic
implementation warns, naming itself, instead of stopping the run -- and ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` where it
is unset. cuBLAS reads that variable when it starts, so it is set before the run touches CUDA; a process whose cuBLAS
already started keeps its workspace, and a warning says so. The previous torch setting is restored afterwards.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator

import torch

CUBLAS_ENV = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_FIXED_WORKSPACE = ":4096:8"


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool = True) -> Iterator[None]:
    """Run the block with torch's deterministic algorithms and a fixed cuBLAS workspace (module docstring); a no-op
    when ``enabled`` is False."""
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
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
