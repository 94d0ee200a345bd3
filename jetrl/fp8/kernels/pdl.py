"""Programmatic dependent launch (PDL): a decode GEMM loads its weight while the kernel before it still runs.

Why: at decode sizes a Gluon GEMM (gemm_gluon.py; which rows it takes: ``choose_backend`` in gemm.py) streams its
weight through a ring of shared-memory slots, and its first loads -- the pipeline fill -- are a fixed cost per call:
at M = 64 the four GEMMs of an 8B layer run at 1.8-3.2 TB/s against 4.3 (docs/benchmarks.md (c)). The weight is
written by no kernel in flight (only between optimizer steps), so the GEMM can start while the kernel before it --
the one that writes its input -- still runs, fill its ring with weight tiles, and wait only before its activation
loads.

The protocol (PTX ``griddepcontrol``; SM90+, kept by CUDA graphs):

* the GEMM is launched with the PDL attribute. Before ``griddepcontrol.wait`` it reads the weight and nothing
  else; after it, the kernel before it has completed and its writes are visible. Then it releases its own
  dependents (``griddepcontrol.launch_dependents``);
* the kernels that write a GEMM's input -- the activation quantization, the RMSNorm and SwiGLU epilogues, the
  decode attention and its merge -- execute ``griddepcontrol.launch_dependents`` first thing (``release``), so
  the GEMM after them is scheduled while they run. They are launched plainly: each starts after the kernel
  before it has completed, so at most the releasing kernel and the GEMM are in flight together.

The rule that makes the early weight read safe: **the kernel right before a PDL GEMM never writes its weight**. Only
after ``griddepcontrol.wait`` is the previous kernel's memory guaranteed visible, whether it released early or not.
It holds by construction: the kernels that release never write a weight (a test holds the quantize kernel to it:
the 128x128 weight quantization compiles the release out), and the weight writers -- the 128x128 quantization of a
weight-cache refresh, the transpose of its codes, the optimizer -- are followed by other work before any decode GEMM
(the cache's finite check syncs the host; the scales' transposing copy; the stacked weights' copies; a whole
prefill). The values computed never change -- only when the GEMM's loads are issued (tests compare PDL and plain
launches bit for bit, also under CUDA-graph replay with the input rewritten between replays).

Where: Gluon GEMMs of at most ``PDL_MAX_M`` (64) rows, and the kernels writing inputs of at most that many
rows. Above it everything is launched plainly -- the trainer, the prefill and the B = 256 decode step -- and the
release instruction is a branch not taken (norms, SwiGLU) or compiled out (the rest).

Measured on the H200 (docs/benchmarks.md (c)), PDL off and on in one process, bench/probe_pdl_prefetch.py:
the four GEMMs of one 8B layer, each after its input's quantization, 80.7-80.9 -> 77.3-77.4 µs at M = 64 (runs BQ,
BR); the 36-layer decode step at B = 64 (the RL step's rollout) 2.5-3.1% faster in ``jet`` and 3.0-3.8% in
``jet_kv`` (runs BQ, BR, BT), ``bf16`` even. Run BP measured and dropped two variants: asking L2 for 8-32 more groups of
the weight before the wait (``cp.async.bulk.prefetch.L2``: slower), and the producers PDL-launched themselves.

Switch: ``JETRL_PDL=0`` launches everything plainly; :func:`use_pdl` forces either inside a block. Off CUDA SM90+
and under the interpreter it is off, and no kernel contains the instruction (ptxas rejects it below sm_90).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents  # Triton >= 3.4, as rounding.py's triton.knobs

from jetrl.fp8.kernels import capability
from jetrl.fp8.kernels.rounding import INTERPRET
from jetrl.overrides import ScopedOverride, env_choice

ENV = "JETRL_PDL"
# Decode GEMMs of up to this many rows are PDL-launched, and only their inputs' producers release early. The decode
# step's gains were measured at B = 64 (module docstring). Above: the four GEMMs after their quantization, all on
# Gluon and all PDL-launched, gained 3% at M = 128 (runs BQ, BR) and 5% or nothing at M = 256 (runs BQ / BR), and
# the B = 256 step could not be measured cleanly (`release_rows`); bench/probe_pdl_prefetch.py takes PDL_MAX_M=256.
PDL_MAX_M = 64
_override = ScopedOverride("PDL setting", (True, False))


def gdc_supported(device: torch.device) -> bool:
    """True where kernels for ``device`` may contain ``griddepcontrol`` at all: CUDA SM90+ and not the interpreter
    (ptxas rejects the instruction below sm_90). The norms and SwiGLU compile it in only here (``release_when``),
    so an A100 never sees it."""
    return device.type == "cuda" and not INTERPRET and capability(device) >= (9, 0)


def pdl_enabled(device: torch.device) -> bool:
    """True where decode GEMMs on ``device`` are PDL-launched and their input's producers release early:
    ``gdc_supported`` (CUDA SM90+, not the interpreter), and neither ``JETRL_PDL=0`` nor ``use_pdl(False)``
    (``use_pdl(True)`` cannot turn it on where the GPU lacks it)."""
    if not gdc_supported(device):
        return False
    if _override.value is not None:
        return _override.value
    return _env_setting()


@functools.cache
def _env_setting() -> bool:
    """``JETRL_PDL``, read once: unset or 1 = on, 0 = off, anything else an actionable error."""
    return env_choice(ENV, ("0", "1"), "1 = programmatic dependent launch on SM90+, the default; 0 = off") != "0"


def release_rows(device: torch.device, rows: int) -> bool:
    """Whether a kernel writing a ``rows``-row input of a GEMM on ``device`` releases early: with PDL on, up to
    ``PDL_MAX_M`` rows, where the GEMM after it may be PDL-launched (a Gluon one; where the Triton kernel takes the
    GEMM, it is not PDL-launched, and the release is then a no-op); above, the BF16 baseline's and the trainer's kernels
    launch plainly. (Runs BQ-BS released at every row count: the probe's B = 256 step was 1.2-1.6% slower in
    ``bf16`` and 3.5-4.6% in ``jet`` with it, while the bench's step in run BR, with it, matched earlier runs; run
    BT, with this gate, measured the same probe's two B = 256 arms -- then running the same kernels -- 0.6-2.6%
    apart: the probe's B = 256 A/B was biased by about that much, and the release was never shown to cost anything.)"""
    return rows <= PDL_MAX_M and pdl_enabled(device)


def use_pdl(on: bool) -> contextlib.AbstractContextManager[None]:
    """Force PDL on or off inside the block (tests, the bench's A/B) where the GPU has it. Graphs captured inside
    keep it."""
    return _override(on)


@triton.jit
def release(RELEASE: tl.constexpr):
    """First statement of a kernel that writes a GEMM's input and never a weight (module docstring)."""
    if RELEASE:
        gdc_launch_dependents()


@triton.jit
def release_when(flag, GDC: tl.constexpr):
    """``release`` on a runtime flag, for the kernels that must stay one binary in the trainer and the engine (the
    norms and SwiGLU: producer_quant.py); ``GDC`` (``gdc_supported``: a property of the device, so still one binary
    per device) compiles the instruction in at all. A uniform branch, taken only with PDL on."""
    if GDC:  # noqa: SIM102 -- a constexpr: the instruction must not even be compiled where GDC is off
        if flag != 0:
            gdc_launch_dependents()
