"""Sibling BF16 projections as one GEMM without autograd on CUDA: q/k/v of an attention, gate/up of an MLP.

Why: at rollout batch sizes separate BF16 projections cost more than one GEMM over their stacked
weight -- k_proj and v_proj (1024 x 4096 at Qwen3-8B) are too narrow to run at HBM speed alone,
and at M = 256 gate and up each leave part of a wave idle (docs/benchmarks.md, section c: at M =
256, 109.5 µs for the five GEMMs, 96.0 stacked; at M <= 64, 85-87 against 65-68). The FP8 recipes
stack the same siblings (jetrl/fp8/projection_group.py, zero copy since jetrl owns the FP8 codes);
this gives the BF16 baseline the same advantage, so that FP8-vs-BF16 ratios compare like with like:

    [y_q | y_k | y_v] = x . [W_q; W_k; W_v]^T (+ [b_q; b_k; b_v]),    [y_gate | y_up] likewise

The BF16 weights are the trainer's parameters, so a stack is a *copy*: q/k/v and gate/up once more
(9.0 GB at Qwen3-8B, 55% of its weights; a rollout engine such as vLLM next to a trainer holds a
copy of every weight). Where memory is short, ``JETRL_BF16_STACKS=0`` (read when the model is
converted) installs no stacks: separate GEMMs, no copy. The trainer's out-of-memory message says so
when stacks hold memory (jetrl/rl/memory.py).

Freshness: a stack is keyed by each member's ``(data_ptr, _version)`` and refreshed in place (same
buffer, so a CUDA graph that captured the stacked GEMM reads the new weights) whenever an eager
call or :func:`refresh_stacked_projections` finds it stale. The trainer refreshes after each
optimizer step (``jetrl.fp8.refresh_weight_caches``), the engine before it captures or replays its
graphs. Writes that bypass the version counter need ``jetrl.fp8.track_optimizer`` (fused
optimizers) or a call to :meth:`StackedProjections.invalidate`.

When: only without autograd (rollout, old-logprob passes), on CUDA, when the siblings are plain
``nn.Linear`` in the input's dtype. Training keeps separate GEMMs (each has its own backward), the
CPU keeps them too (its trainer/engine bit-exactness is untouched), and FP8 members are left to
their own projection group. Values: the same dot products, but cuBLAS may pick another kernel for
the wider N, so outputs can differ from separate calls by the GEMM's rounding (as the engine's
batch-invariance tolerance already allows; tests/test_stacked_projections.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from jetrl.overrides import env_choice

ENV = "JETRL_BF16_STACKS"

# the module slot that holds a stack -> the sibling projections it stacks (HF names, as jetrl.models uses them;
# the FP8 projection groups stack the same siblings)
SLOTS = {"qkv_stack": ("q_proj", "k_proj", "v_proj"), "gate_up_stack": ("gate_proj", "up_proj")}


class StackedProjections:
    """Sibling projections of one module as one GEMM over a stacked copy of their weights (module docstring).

    Installed in a module's slot (``Attention.qkv_stack``, ``MLP.gate_up_stack``); ``stack(module, x)``
    returns the members' outputs (column views of one GEMM output) or None where it does not apply.
    """

    def __init__(self, names: tuple[str, ...], devices: tuple[str, ...] = ("cuda",)) -> None:
        self.names = names
        self.devices = devices  # where the stacked path runs (tests widen it to the CPU)
        self.weight: Tensor | None = None
        self.bias: Tensor | None = None
        self._key: tuple | None = None

    def __call__(self, module: nn.Module, x: Tensor) -> tuple[Tensor, ...] | None:
        members = self.members(module)
        if members is None or not self.applies(members, x):
            return None
        weight, bias = self.stacked(members)
        y = F.linear(x, weight, bias)
        outs, offset = [], 0
        for m in members:
            outs.append(y[..., offset:offset + m.out_features])
            offset += m.out_features
        return tuple(outs)

    def members(self, module: nn.Module) -> tuple[nn.Linear, ...] | None:
        """The siblings of ``module`` when all are plain ``nn.Linear`` of one dtype, device and input size."""
        members = tuple(getattr(module, n, None) for n in self.names)
        if not all(type(m) is nn.Linear for m in members):  # missing, or an FP8 transform took them over
            return None
        first = members[0]
        if any(m.weight.dtype != first.weight.dtype or m.weight.device != first.weight.device
               or m.in_features != first.in_features or (m.bias is None) != (first.bias is None) for m in members):
            return None
        return members

    def applies(self, members: tuple[nn.Linear, ...], x: Tensor) -> bool:
        w = members[0].weight
        return (not torch.is_grad_enabled() and x.device.type in self.devices and x.dtype == w.dtype
                and x.device == w.device)

    def stacked(self, members: tuple[nn.Linear, ...]) -> tuple[Tensor, Tensor | None]:
        """The members' current weights (and biases) stacked along N, refreshed in place if stale."""
        key = tuple((m.weight.data_ptr(), m.weight._version, tuple(m.weight.shape),
                     None if m.bias is None else (m.bias.data_ptr(), m.bias._version)) for m in members)
        if key != self._key:
            with torch.no_grad():
                self._write(members)
            self._key = key
        return self.weight, self.bias

    def _write(self, members: tuple[nn.Linear, ...]) -> None:
        w = members[0].weight
        n = sum(m.out_features for m in members)
        if self.weight is None or self.weight.shape != (n, w.shape[1]) or self.weight.dtype != w.dtype or \
                self.weight.device != w.device:
            self.weight = torch.empty((n, w.shape[1]), dtype=w.dtype, device=w.device)
            has_bias = members[0].bias is not None
            self.bias = torch.empty(n, dtype=members[0].bias.dtype, device=w.device) if has_bias else None
        offset = 0
        for m in members:
            self.weight[offset:offset + m.out_features].copy_(m.weight)
            if self.bias is not None:
                self.bias[offset:offset + m.out_features].copy_(m.bias)
            offset += m.out_features

    def invalidate(self) -> None:
        """Forget the members' versions: the next use copies them again (into the same buffer)."""
        self._key = None


def stacks_enabled() -> bool:
    """False when ``JETRL_BF16_STACKS=0`` (module docstring)."""
    return env_choice(ENV, ("0", "1"), "1 = one GEMM per sibling group in BF16 rollouts, 0 = separate GEMMs and "
                      "no stacked copy") != "0"


def install_stacked_projections(model: nn.Module, devices: tuple[str, ...] = ("cuda",)) -> int:
    """Fill every stack slot of ``model`` (``SLOTS``) with a :class:`StackedProjections`; returns how many
    (none when ``JETRL_BF16_STACKS=0``)."""
    if not stacks_enabled():
        return 0
    count = 0
    for module in model.modules():
        for slot, names in SLOTS.items():
            if hasattr(module, slot) and all(hasattr(module, n) for n in names):
                if not isinstance(getattr(module, slot), StackedProjections):
                    setattr(module, slot, StackedProjections(names, devices))
                count += 1
    return count


def _installed(model: nn.Module) -> Iterator[tuple[nn.Module, str, StackedProjections]]:
    """(module, slot, stack) for every installed stack of ``model``."""
    for module in model.modules():
        for slot in SLOTS:
            stack = getattr(module, slot, None)
            if isinstance(stack, StackedProjections):
                yield module, slot, stack


def refresh_stacked_projections(model: nn.Module) -> list[Tensor]:
    """Bring every installed stack up to date now (eagerly, outside any CUDA graph); returns the stacked
    weights in use, so a caller can tell whether one was reallocated."""
    buffers = []
    for module, _, stack in _installed(model):
        members = stack.members(module)
        if members is not None and members[0].weight.device.type in stack.devices:
            buffers.append(stack.stacked(members)[0])
    return buffers


def stacked_bytes(model: nn.Module) -> int:
    """Device bytes held by the stacked copies of ``model`` now."""
    return sum(t.numel() * t.element_size() for _, _, stack in _installed(model)
               for t in (stack.weight, stack.bias) if t is not None)


def remove_stacked_projections(model: nn.Module) -> None:
    """Empty every stack slot (frees the copies)."""
    for module, slot, _ in list(_installed(model)):
        setattr(module, slot, None)
