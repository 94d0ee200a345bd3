"""Sibling projections in one FP8 GEMM: q/k/v of an attention, gate/up of an MLP.

Why: at rollout batch sizes (M = 256 rows) cuBLAS block FP8 costs ~15 µs per call whatever the
weight (docs/benchmarks.md, section c): k_proj and v_proj (1024 x 4096) take as long as q_proj, and
the seven projections of a layer cost 1.4x the four GEMMs of the same weights concatenated. The
projections that read the same input can run as one GEMM against their weights stacked along N:

    [y_q | y_k | y_v] = q(x) . [q(W_q); q(W_k); q(W_v)]^T

Exactness of the stacking: the weights are quantized in 128 x 128 blocks, so when every member's
N is a multiple of 128 the blocks of the stacked weight are exactly the members' blocks -- the
stacked codes and scales *are* the members' codes and scales, bit for bit. The activation's
1 x 128 groups run along K and are shared. Only the GEMM's internal order of work may differ from
three separate calls (on the GPU; the CPU path never groups, see below).

Zero copy: the group owns one stacked buffer (codes (N_total, K), scales (N_total/128, K/128)),
and each member's :class:`~jetrl.fp8.weight_cache.WeightCache` entry is a row-slice *view* of it.
A member's cache refreshes in place (weight_cache.py), so re-quantizing a member after an optimizer
step writes straight into the stacked buffer: the group never copies weights, and CUDA graphs that
captured the stacked GEMM read the new codes. (An entry that stopped being a view -- a checkpoint
primed its codes, the weight moved device -- is copied back in and re-pointed on the next call.)

When: only without autograd (rollout, old-logprob passes), on CUDA, when every member is an FP8
``Float8Linear`` of the same recipe and input size with N a multiple of 128. Training keeps
separate GEMMs (each member's backward is its own), and the CPU keeps them too, so the CPU's
trainer/engine bit-exactness is untouched. The first member called computes the stacked output
for an input tensor; the others return their column slice of it (input_memo.py makes the hit exact,
as for the shared input quantization in linear.py).
The group lets go of the stacked output once every member has taken its slice, so no group keeps a
prefill-sized activation alive between calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from jetrl.fp8.gemm import fp8_gemm
from jetrl.fp8.input_memo import InputMemo
from jetrl.fp8.quant import BLOCK, E4M3, Float8Blocks
from jetrl.fp8.recipe import LinearPrecision, QuantSpec
from jetrl.models.stacked_projections import SLOTS

if TYPE_CHECKING:
    from jetrl.fp8.linear import Float8Linear

SIBLINGS = tuple(SLOTS.values())  # q/k/v, gate/up: the siblings the BF16 stacks take too


class ProjectionGroup:
    """Float8Linear members that read the same input, computed as one stacked FP8 GEMM (module docstring)."""

    def __init__(self, members: list[Float8Linear]) -> None:
        self.members = list(members)
        self.offsets, total = [], 0
        for m in self.members:
            self.offsets.append(total)
            total += m.out_features
        self.out_features = total
        self._stacked: Float8Blocks | None = None
        self._views: list[Float8Blocks] = []
        self._memo = InputMemo()  # the stacked output for the current input
        self._unread: set[int] = set()

    @staticmethod
    def can_group(members: list[nn.Module]) -> bool:
        from jetrl.fp8.linear import Float8Linear

        if len(members) < 2 or not all(type(m) is Float8Linear for m in members):
            return False
        first = members[0]
        return all(m.recipe == first.recipe and m.in_features == first.in_features and m.out_features % BLOCK == 0
                   for m in members)

    def applies(self, x: torch.Tensor, spec: LinearPrecision) -> bool:
        """Whether this call may take the stacked path: CUDA, no autograd, the members' weight spec 128x128,
        and an input with a version counter (not a ``torch.inference_mode`` tensor)."""
        return (x.is_cuda and not torch.is_grad_enabled() and not x.is_inference()
                and spec.weight.block == (BLOCK, BLOCK))

    def output(self, member: Float8Linear, x: torch.Tensor, spec: LinearPrecision, quantize_input) -> torch.Tensor:
        """``member``'s (M, n) output: a column slice of the stacked GEMM of ``x`` (computed once per input)."""

        def stacked_gemm() -> torch.Tensor:
            self._unread = set(range(len(self.members)))
            return fp8_gemm(quantize_input(), self.stacked_weight(spec.weight), out_dtype=x.dtype)

        out = self._memo.get(x, spec, stacked_gemm)
        index = self.members.index(member)
        self._unread.discard(index)
        if not self._unread:  # every member has its slice: hold no reference to a (prefill-sized) output
            self._memo.clear()
        return out[:, self.offsets[index]:self.offsets[index] + member.out_features]

    def stacked_weight(self, spec: QuantSpec) -> Float8Blocks:
        """The members' current FP8 weights, stacked along N, with no copy (module docstring)."""
        fresh = [m.weight_cache.get(m.weight, spec) for m in self.members]  # refreshes in place if stale
        if self._stacked is None or self._stacked.codes.device != fresh[0].codes.device or \
                self._stacked.codes.shape[1] != fresh[0].codes.shape[1]:
            self._allocate(fresh[0])
        for m, q, view in zip(self.members, fresh, self._views):
            if q.codes.data_ptr() != view.codes.data_ptr():  # first use, or the entry was replaced: re-point it
                view.codes.copy_(q.codes)
                view.scales.copy_(q.scales)
                m.weight_cache.adopt(view)
        return self._stacked

    def _allocate(self, like: Float8Blocks) -> None:
        k = like.codes.shape[1]
        codes = torch.empty((self.out_features, k), dtype=E4M3, device=like.codes.device)
        scales = torch.empty((self.out_features // BLOCK, like.scales.shape[1]), dtype=torch.float32,
                             device=like.scales.device)
        self._stacked = Float8Blocks(codes, scales, (BLOCK, BLOCK))
        self._views = [Float8Blocks(codes[o:o + m.out_features], scales[o // BLOCK:(o + m.out_features) // BLOCK],
                                    (BLOCK, BLOCK)) for o, m in zip(self.offsets, self.members)]


def install_projection_groups(model: nn.Module) -> int:
    """Group the sibling Float8Linear projections of every module of ``model`` (``SIBLINGS``); returns how many."""
    count = 0
    for module in model.modules():
        for names in SIBLINGS:
            members = [getattr(module, n, None) for n in names]
            if all(m is not None for m in members) and ProjectionGroup.can_group(members):
                group = ProjectionGroup(members)
                for m in members:
                    m.projection_group = group
                count += 1
    return count
