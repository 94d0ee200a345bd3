"""Programmatic dependent launch (PDL): a kernel starts while the kernel before it drains.

Why: a decode step is a chain of ~20 small kernels per layer, each a few µs to ~100 µs, and every
boundary costs the launch of the next grid plus its ramp-up while the previous grid's last wave
drains. On SM90, a kernel launched with the PDL attribute may start as soon as every program of
the kernel before it has executed ``griddepcontrol.launch_dependents``; it must then execute
``griddepcontrol.wait`` before touching anything that kernel writes, and the wait returns once that
kernel has completed and its memory is visible. CUDA graphs keep these edges when captured.

The protocol every jetrl kernel follows (one function, :func:`wait_then_release`):

    prologue that reads no tensor a previous kernel may write   (offsets, program ids)
    griddepcontrol.wait                  -- the previous kernel is complete, its writes visible
    griddepcontrol.launch_dependents     -- the next kernel may start its own prologue
    the kernel's loads and stores

The release comes *after* the wait, so a kernel that starts early can overlap only its direct
predecessor, which has itself passed its wait: everything before that predecessor is complete. No
kernel reads or writes a tensor before its wait, so the early start changes no result, only the gaps:
the computed values are those of the serial launch, bit for bit (tests compare them).

Switch: ``JETRL_PDL=0`` launches every kernel plainly; :func:`use_pdl` forces either inside a block
(the bench measures both in one process). Off SM90, under the interpreter, and on CPU the launch
attribute is never set and the two instructions are compiled out (``PDL`` is a constexpr).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from jetrl.overrides import ScopedOverride, env_choice

try:  # Triton >= 3.4 exposes the two instructions; older Triton launches everything plainly
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - depends on the installed Triton
    gdc_launch_dependents = gdc_wait = None

_override = ScopedOverride("PDL setting", (True, False))
_resolved: dict[str, bool] = {}


def pdl_enabled(device: torch.device) -> bool:
    """True where kernels on ``device`` are launched with PDL: CUDA SM90+, Triton with the GDC
    instructions, not the interpreter, and neither ``JETRL_PDL=0`` nor ``use_pdl(False)``."""
    if device.type != "cuda" or gdc_wait is None or triton.knobs.runtime.interpret:
        return False
    if _override.value is not None:
        return _override.value
    key = f"{device.type}:{device.index}"
    if key not in _resolved:
        _resolved[key] = env_setting() and torch.cuda.get_device_capability(device) >= (9, 0)
    return _resolved[key]


def env_setting() -> bool:
    """``JETRL_PDL``: unset or 1 = on where the GPU has it, 0 = off; anything else raises an actionable error."""
    return env_choice("JETRL_PDL", ("0", "1"), "1 = programmatic dependent launch on SM90+, the default; 0 = off") != "0"


def launch_options(device: torch.device) -> dict:
    """Keyword arguments for a kernel launch on ``device``: ``PDL`` (the kernel's constexpr) and, when
    on, ``launch_pdl`` (the launch attribute). Splat into every launch: ``kernel[grid](..., **opts)``."""
    on = pdl_enabled(device)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


def use_pdl(on: bool) -> contextlib.AbstractContextManager[None]:
    """Force PDL on or off inside the block (tests, the bench's A/B). Graphs captured inside keep it."""
    return _override(on)


@triton.jit
def wait_then_release(PDL: tl.constexpr):
    """The kernel's dependency point (module docstring): wait for the previous kernel, then let the next start."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
