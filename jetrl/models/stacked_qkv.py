"""q, k and v of a BF16 attention as one GEMM, without autograd on CUDA.

Why: at rollout batch sizes the three BF16 projections cost more than one GEMM over their
stacked weight -- k_proj and v_proj (1024 x 4096 at Qwen3-8B) are too narrow to run at HBM
speed alone (docs/benchmarks.md, section c: at M = 256 stacking q/k/v and gate/up saves 12.3
µs per layer, almost all of it q/k/v). The FP8 recipes stack their siblings already
(jetrl/fp8/projection_group.py: zero copy, since jetrl owns the FP8 codes); this gives the BF16
baseline the same advantage, so that FP8-vs-BF16 ratios compare like with like:

    [y_q | y_k | y_v] = x . [W_q; W_k; W_v]^T (+ [b_q; b_k; b_v])

The BF16 weights are the trainer's parameters, so the stack is a *copy*: the q/k/v weights once
more (1.8 GB at Qwen3-8B, 11% of its weights). gate/up are not stacked: two 12288-wide GEMMs
already run near the bytes floor, and their stack would cost 7.2 GB more.

Freshness: the copy is keyed by each member's ``(data_ptr, _version)`` and refreshed in place
(same buffer, so a CUDA graph that captured the stacked GEMM reads the new weights) whenever an
eager call or :func:`refresh_stacked_qkv` finds it stale. The trainer refreshes after each
optimizer step (``jetrl.fp8.refresh_weight_caches``), the engine before it captures or replays
its graphs. Writes that bypass the version counter need ``jetrl.fp8.track_optimizer`` (fused
optimizers) or a call to :meth:`StackedQKV.invalidate`.

When: only without autograd (rollout, old-logprob passes), on CUDA, when q/k/v are plain
``nn.Linear`` in the input's dtype. Training keeps three GEMMs (each has its own backward), the
CPU keeps them too (its trainer/engine bit-exactness is untouched), and FP8 members are left to
their own projection group. Values: the same dot products, but cuBLAS may pick another kernel
for the wider N, so outputs can differ from three separate calls by the GEMM's rounding (as the
engine's batch-invariance tolerance already allows; tests/test_stacked_qkv.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

NAMES = ("q_proj", "k_proj", "v_proj")


class StackedQKV:
    """An attention's q/k/v as one GEMM over a stacked copy of their weights (module docstring).

    Installed as ``Attention.qkv_stack``; ``stack(attn, x)`` returns ``(q, k, v)`` (column views of
    one output) or None where the stacked path does not apply.
    """

    def __init__(self, devices: tuple[str, ...] = ("cuda",)) -> None:
        self.devices = devices  # where the stacked path runs (tests widen it to the CPU)
        self.weight: Tensor | None = None
        self.bias: Tensor | None = None
        self._key: tuple | None = None

    def __call__(self, attn: nn.Module, x: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
        members = self.members(attn)
        if members is None or not self.applies(members, x):
            return None
        weight, bias = self.stacked(members)
        y = F.linear(x, weight, bias)
        n_q, n_k = members[0].out_features, members[1].out_features
        return y[..., :n_q], y[..., n_q:n_q + n_k], y[..., n_q + n_k:]

    @staticmethod
    def members(attn: nn.Module) -> tuple[nn.Linear, nn.Linear, nn.Linear] | None:
        """q/k/v of ``attn`` when all three are plain ``nn.Linear`` of one dtype and device, else None."""
        members = tuple(getattr(attn, n, None) for n in NAMES)
        if not all(type(m) is nn.Linear for m in members):  # an FP8 transform took them over
            return None
        w = members[0].weight
        if any(m.weight.dtype != w.dtype or m.weight.device != w.device or m.in_features != members[0].in_features
               or (m.bias is None) != (members[0].bias is None) for m in members):
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


def install_stacked_qkv(model: nn.Module, devices: tuple[str, ...] = ("cuda",)) -> int:
    """Set a :class:`StackedQKV` on every attention of ``model`` with a ``qkv_stack`` slot; returns how many."""
    count = 0
    for module in model.modules():
        if hasattr(module, "qkv_stack") and all(hasattr(module, n) for n in NAMES):
            if not isinstance(module.qkv_stack, StackedQKV):
                module.qkv_stack = StackedQKV(devices)
            count += 1
    return count


def refresh_stacked_qkv(model: nn.Module) -> list[Tensor]:
    """Bring every installed stack up to date now (eagerly, outside any CUDA graph); returns the stacked
    weights in use, so a caller can tell whether one was reallocated."""
    buffers = []
    for module in model.modules():
        stack = getattr(module, "qkv_stack", None)
        if isinstance(stack, StackedQKV):
            members = stack.members(module)
            if members is not None and members[0].weight.device.type in stack.devices:
                buffers.append(stack.stacked(members)[0])
    return buffers
