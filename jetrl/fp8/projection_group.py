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

When: on CUDA, when every member is an FP8 ``Float8Linear`` of the same recipe, input size and weight
dtype with N a multiple of 128; the CPU keeps separate GEMMs, so the CPU's trainer/engine bit-exactness
is untouched. The first member called computes the stacked output for an input tensor; the others
return their column slice of it (input_memo.py makes the hit exact, as for the shared input
quantization in linear.py); a member that calls twice computes afresh. The group lets go of the
stacked output once every member has taken its slice (or at the next input, if a member is never
called), so no group keeps a prefill-sized activation alive past its layer.

* Without autograd (rollout, old-logprob passes): one stacked GEMM, each member a column slice.
* In training (linear.py ``_StackedFloat8LinearFn``) the members are one autograd Function too:

      fprop  [Y_1 | ... | Y_n] = q(X) . W_s^T               W_s = [q(W_1); ...; q(W_n)]  (the stacked codes)
      dgrad  dX   = q([dY_1 | ... | dY_n]) . (W_s^T)^T       one GEMM, fp32 over all n members' columns
      wgrad  dW_s = q([dY_1 | ... | dY_n]^T) . q(X^T)^T      dW_i = its row block

  The members' gradients are quantized straight into their columns of the stacked dY (no
  concatenation; each group of 128 columns is one member's, so the codes are each member's own), and
  W_s^T is built once per weight version from the stacked codes. Against separate members: a layer's
  seven FP8 fwd+bwd calls become four, q/k/v's dX is one GEMM instead of three GEMMs and two BF16
  additions (gate/up: two and one), and k/v's narrow GEMMs join q's. What pays is the host: an eager
  FP8 fwd+bwd costs ~0.7-1.4 ms of host time whatever its size (bench/probe_host_parts.py), so small
  models trained slower in FP8 than in BF16: 0.76-0.99x at Qwen3-1.7B's shapes, 0.93-1.13x with this
  (machines differ); 0.48x -> 0.59x at 0.6B (bench/probe_model_sizes.py, docs/benchmarks.md (f)).
  dX is rounded once instead of after each member's GEMM and their sum: not bit-equal to separate
  members, and no less accurate.
  Two differences a caller can see: the members' outputs are column views of one tensor, so an
  in-place op on one raises autograd's view error (jetrl's models do none: norm_rope, the KV
  transform and SwiGLU are out of place), and the members' weight gradients are row views of one
  wgrad buffer (accumulation over micro-batches adds into each view). A member whose output is
  unused gets no gradient, as when it runs alone. ``JETRL_STACKED_TRAINING=0`` (read when a group is
  built, i.e. when the model is converted) trains the members separately, as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from jetrl.fp8.gemm import fp8_gemm
from jetrl.fp8.input_memo import InputMemo
from jetrl.fp8.quant import BLOCK, E4M3, Float8Blocks, transpose_codes
from jetrl.fp8.recipe import LinearPrecision, QuantSpec
from jetrl.fp8.weight_cache import note_weight_read
from jetrl.models.stacked_projections import SLOTS
from jetrl.overrides import env_choice

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
        self.name = _group_name([m.fqn for m in self.members])
        self.devices = ("cuda",)  # where the stacked paths run (tests widen it to the CPU)
        self.train_stacked = stacked_training_enabled()
        self._stacked: Float8Blocks | None = None
        self._views: list[Float8Blocks] = []
        self._stacked_t: Float8Blocks | None = None  # W_s^T for dgrad, and the version it was built from
        self._stacked_t_key: tuple | None = None
        self._writes = 0  # copies into the stacked buffer (a re-pointed member): part of W_s^T's version
        self._memo = InputMemo()  # the stacked output for the current input
        self._unread: set[int] = set()

    @staticmethod
    def can_group(members: list[nn.Module]) -> bool:
        from jetrl.fp8.linear import Float8Linear

        if len(members) < 2 or not all(type(m) is Float8Linear for m in members):
            return False
        first = members[0]
        return all(m.recipe == first.recipe and m.in_features == first.in_features and m.out_features % BLOCK == 0
                   and m.weight.dtype == first.weight.dtype for m in members)

    def applies(self, x: torch.Tensor, spec: LinearPrecision) -> bool:
        """Whether this call may take the stacked path: CUDA, no autograd, the members' weight spec 128x128,
        and an input with a version counter (not a ``torch.inference_mode`` tensor)."""
        return (x.device.type in self.devices and not torch.is_grad_enabled() and not x.is_inference()
                and spec.weight.block == (BLOCK, BLOCK))

    def trains(self, x: torch.Tensor, spec: LinearPrecision) -> bool:
        """Whether a training call may take the stacked Function: CUDA (``devices``), an input with a version counter, 128x128
        weight blocks, every member's weight trained, and the gradient's two layouts one 1x128 spec (the dual
        quantizer writes both; the recipes' own)."""
        grad = spec.grad_output
        return (self.train_stacked and x.device.type in self.devices and not x.is_inference()
                and spec.weight.block == (BLOCK, BLOCK)
                and grad is not None and grad == spec.wgrad and grad.block == (1, BLOCK)
                and all(m.weight.requires_grad for m in self.members))

    def columns(self) -> list[tuple[int, int]]:
        """(first column, width) of each member's block of the stacked output."""
        return [(o, m.out_features) for o, m in zip(self.offsets, self.members)]

    def output(self, member: Float8Linear, x: torch.Tensor, spec: LinearPrecision, quantize_input) -> torch.Tensor:
        """``member``'s (M, n) output: a column slice of the stacked GEMM of ``x`` (computed once per input)."""
        stacked = self._shared(member, x, spec,
                               lambda: fp8_gemm(quantize_input(), self.stacked_weight(spec.weight), out_dtype=x.dtype))
        offset = self.offsets[self.members.index(member)]
        return stacked[:, offset:offset + member.out_features]

    def train_output(self, member: Float8Linear, x: torch.Tensor, spec: LinearPrecision, apply) -> torch.Tensor:
        """``member``'s (M, n) output from the members' one autograd Function (``apply()``, run once per input)."""
        return self._shared(member, x, ("train", spec), apply)[self.members.index(member)]

    def _shared(self, member: Float8Linear, x: torch.Tensor, key, compute):
        """``compute()`` once per input ``x`` for all members; let go of it once every member has read it. A member
        that calls again before the others have read (the same input, e.g. after its weight changed) computes
        afresh: a held result serves each member once."""

        def first():
            self._unread = set(range(len(self.members)))
            return compute()

        index = self.members.index(member)
        if index not in self._unread:
            self._memo.clear()
        out = self._memo.get(x, key, first)
        self._unread.discard(index)
        if not self._unread:  # every member has its part: hold no reference to a (prefill-sized) output
            self._memo.clear()
        return out

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
                self._writes += 1
        note_weight_read(self, "W_s", self._stacked, self.stacked_weight, self._settle_stacked, spec)
        return self._stacked

    def _settle_stacked(self, spec: QuantSpec) -> None:
        """Nothing: W_s *is* the members' buffers, which their caches settle (weight_cache.WeightRead)."""

    def stacked_weight_t(self, spec: QuantSpec) -> Float8Blocks:
        """W_s^T (K, N_total) for dgrad, from the stacked codes (never re-quantized), rebuilt in place when a member's
        weight was re-quantized or re-pointed since the last call."""
        stacked = self.stacked_weight(spec)
        key = self._stacked_t_version()
        if key != self._stacked_t_key:
            old = self._stacked_t
            if old is None or old.codes.shape != stacked.codes.shape[::-1] or old.codes.device != stacked.codes.device:
                self._stacked_t = stacked.t()
            else:
                transpose_codes(stacked.codes, out=old.codes)
                old.scales.copy_(stacked.scales.t())
            self._stacked_t_key = key
        note_weight_read(self, "W_s^T", self._stacked_t, self.stacked_weight_t, self._settle_stacked_t, spec)
        return self._stacked_t

    @property
    def has_stacked_t(self) -> bool:
        """Whether W_s^T is held (a dgrad read it): a full refresh rewrites it too (refresh_graph.py)."""
        return self._stacked_t is not None

    def _stacked_t_version(self) -> tuple:
        """What W_s^T is built from: every member's weight version, the copies into W_s, and W_s's address."""
        return (tuple(m.weight_cache.num_quantizations for m in self.members), self._writes,
                self._stacked.codes.data_ptr())

    def _settle_stacked_t(self, spec: QuantSpec) -> None:
        """The host side of :meth:`stacked_weight_t` after a replay rebuilt W_s^T (weight_cache.WeightRead); the
        members' W entries settle first (they were read first)."""
        self._stacked_t_key = self._stacked_t_version()

    def _allocate(self, like: Float8Blocks) -> None:
        k = like.codes.shape[1]
        codes = torch.empty((self.out_features, k), dtype=E4M3, device=like.codes.device)
        scales = torch.empty((self.out_features // BLOCK, like.scales.shape[1]), dtype=torch.float32,
                             device=like.scales.device)
        self._stacked = Float8Blocks(codes, scales, (BLOCK, BLOCK))
        self._views = [Float8Blocks(codes[o:o + m.out_features], scales[o // BLOCK:(o + m.out_features) // BLOCK],
                                    (BLOCK, BLOCK)) for o, m in zip(self.offsets, self.members)]


STACKED_TRAINING_ENV = "JETRL_STACKED_TRAINING"


def stacked_training_enabled() -> bool:
    """False when ``JETRL_STACKED_TRAINING=0`` (module docstring)."""
    return env_choice(STACKED_TRAINING_ENV, ("0", "1"), "1 = sibling projections train as one autograd Function on "
                      "CUDA, 0 = each member its own") != "0"


def _group_name(names: list[str]) -> str:
    """``model.layers.0.self_attn.{q_proj,k_proj,v_proj}`` for the members' qualified names."""
    prefix = names[0].rpartition(".")[0]
    if all(n.rpartition(".")[0] == prefix for n in names):
        return f"{prefix + '.' if prefix else ''}{{{','.join(n.rpartition('.')[2] for n in names)}}}"
    return "+".join(names)


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
