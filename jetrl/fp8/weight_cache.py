"""Quantize each weight once per parameter version.

Every reader of an FP8 weight (the training forward, the rollout engine, the FP8 export)
goes through one :class:`WeightCache` per linear layer, so they all see the very same codes
and scales, and a weight is quantized once per optimizer step instead of once per forward.

Key: ``(param._version, param.data_ptr(), param.device, spec)``. PyTorch bumps ``_version`` on every
in-place write through the parameter by an ordinary op (``load_state_dict``, ``copy_`` under
``no_grad``, the for-loop and foreach optimizers), so a stale entry cannot be read after such a
write. **Fused optimizers do not bump it**: ``torch.optim.AdamW(fused=True)`` writes the
parameters through one kernel and leaves ``_version`` unchanged (measured with torch 2.13 on CPU;
on the H200, torch 2.11, a killed-and-resumed ``jet`` run diverged from the uninterrupted one at
the first step after the resume, because the resumed process quantized the updated weights;
tests/test_trainer.py forces the fused optimizer on CPU). Without help, every FP8 forward after
such a step would read the first step's codes -- trainer and rollout alike, so the mismatch
metrics would stay at zero while the FP8 policy never moved. :func:`track_optimizer` closes the gap: a step
post-hook that bumps the version of every parameter the optimizer holds (the trainer installs
it). Other writes that bypass the counter (``param.data.copy_(...)``, a custom kernel) must call
:meth:`invalidate`. The trainer calls :func:`jetrl.fp8.refresh_weight_caches` after each optimizer
step to fill every cache eagerly (off the rollout's critical path).

dgrad needs W^T. It is derived from the cached codes (:meth:`Float8Blocks.t`), never
re-quantized from BF16, so fprop and dgrad use one set of weight codes.

A new version is written *into the existing buffers* when the layout is unchanged, so every
holder of the cached tensors (a CUDA graph the engine captured, above all) sees the new codes
without a copy to it or a recapture.

Weights are always checked: a NaN/Inf weight raises a :class:`~jetrl.fp8.quant.NonFiniteError`
naming the parameter instead of entering FP8 (its entry stays stale, so every later read raises
again). The check reads the scales on the host, one device sync per weight; refreshing the whole
model after an optimizer step (252 weights at Qwen3-8B) does it once for all of them instead,
inside :func:`batched_finite_check`, so the host never waits on the GPU in the middle of a refresh
(on the H200 the 8B update's wall time did not move measurably: docs/benchmarks.md, section f).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, NamedTuple

import torch

from jetrl.fp8.quant import (
    E4M3,
    Float8Blocks,
    NonFiniteError,
    assert_finite,
    nonfinite_problem,
    quantize,
    transpose_codes,
)
from jetrl.fp8.recipe import QuantSpec

if TYPE_CHECKING:
    from jetrl.fp8.weight_shard import WeightShard


class _Deferred(threading.local):
    pending: list[tuple[WeightCache, Float8Blocks]] | None = None


_deferred = _Deferred()


class _Reads:  # not thread-local: autograd runs a CUDA backward (whose W^T reads count) on a thread of its own
    log: dict[tuple[int, str], WeightRead] | None = None  # recorded_weight_reads


_reads = _Reads()


@contextlib.contextmanager
def recorded_weight_reads() -> Iterator[dict]:
    """Log every cached FP8 weight buffer that is read inside the block (this class's :meth:`WeightCache.get` and
    :meth:`~WeightCache.get_transposed`, a projection group's stacked W and W^T) as ``{key: WeightRead}``, in the
    order first read: ``entry.redo()`` brings that buffer up to date for the weight's current version, in place, and
    returns it. Why: a CUDA graph captured inside the block reads those exact buffers on every replay, but the host
    logic that refreshes them lazily does not run on a replay -- whoever replays it calls every ``redo()`` first
    (jetrl/rl/train_graphs.py) and checks that the addresses held still. Nested blocks share the outermost log.
    The log is process-wide, not per thread: autograd runs a CUDA backward, whose dgrad reads W^T, on its own
    device thread."""
    outer = _reads.log
    _reads.log = {} if outer is None else outer
    try:
        yield _reads.log
    finally:
        _reads.log = outer


class WeightRead(NamedTuple):
    """One logged read (:func:`recorded_weight_reads`): ``owner``'s buffer ``kind`` ("W", "W^T", "W_s", "W_s^T"),
    the ``blocks`` read, and how to bring it up to date: ``redo()`` re-reads it -- writing the weight's current
    version into the same buffers if it is stale -- and ``settle()`` does only the host bookkeeping of such a
    re-read, for when its kernels ran elsewhere (a CUDA-graph replay: jetrl/fp8/refresh_graph.py)."""

    owner: object
    kind: str
    blocks: Float8Blocks
    redo_fn: Callable[..., Float8Blocks]
    settle_fn: Callable[..., None]
    args: tuple

    def redo(self) -> Float8Blocks:
        return self.redo_fn(*self.args)

    def settle(self) -> None:
        self.settle_fn(*self.args)


def note_weight_read(owner: object, kind: str, blocks: Float8Blocks, reread: Callable[..., Float8Blocks],
                     settle: Callable[..., None], *args) -> None:
    """Log a read of ``blocks`` for :func:`recorded_weight_reads`, to be redone as ``reread(*args)`` (and settled as
    ``settle(*args)``: :class:`WeightRead`); a no-op outside one, which builds nothing: readers call it at every
    read."""
    log = _reads.log
    if log is not None:
        log[(id(owner), kind)] = WeightRead(owner, kind, blocks, reread, settle, args)


@contextlib.contextmanager
def batched_finite_check() -> Iterator[None]:
    """Weights quantized inside the block skip their own finiteness check; on leaving it, one check (one
    device sync) covers them all, and raises :class:`NonFiniteError` naming every non-finite weight, whose
    entries are left stale (module docstring). Nested blocks join the outermost."""
    if _deferred.pending is not None:
        yield
        return
    _deferred.pending = pending = []
    try:
        yield
    finally:
        _deferred.pending = None
    _check_all(pending)


def _check_all(pending: list[tuple[WeightCache, Float8Blocks]]) -> None:
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for _, q in pending:
        by_device.setdefault(q.scales.device, []).append(q.scales.reshape(-1))
    if not any(bool((~torch.isfinite(torch.cat(scales))).any()) for scales in by_device.values()):
        return
    problems = [(cache, nonfinite_problem(q, cache.name)) for cache, q in pending]
    bad = [(cache, problem) for cache, problem in problems if problem]
    for cache, _ in bad:
        cache.invalidate()
    names = ", ".join(cache.name for cache, _ in bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
    raise NonFiniteError(f"{len(bad)} weight(s) hold NaN/Inf: {names}. First: {bad[0][1]}")


def track_optimizer(optimizer: torch.optim.Optimizer):
    """Make every ``optimizer.step()`` visible to the weight caches; returns the hook's handle.

    Bumps the version counter of each parameter the optimizer holds after each step (module
    docstring: fused optimizers write parameters without bumping it). A second bump after an
    optimizer that already bumped is harmless. Parameters added to the optimizer later are covered,
    since the hook reads ``param_groups`` at every step.
    """

    def bump(opt: torch.optim.Optimizer, args, kwargs) -> None:
        torch.autograd.graph.increment_version([p for group in opt.param_groups for p in group["params"]])

    return optimizer.register_step_post_hook(bump)


class WeightCache:
    """The FP8 codes of one weight (and its transpose), valid for one parameter version."""

    def __init__(self, name: str = "weight") -> None:
        self.name = name
        self.num_quantizations = 0  # how many times this weight was quantized (tests, metrics)
        # bumped whenever this cache is re-quantized, primed, re-pointed or invalidated: with the weight's version,
        # what tells a CUDA graph's holder that no buffer it reads went stale since it looked (train_graphs.py)
        self.epoch = 0
        self._key: tuple | None = None
        self._weight: Float8Blocks | None = None
        self._weight_t: Float8Blocks | None = None
        self._transposed_stale = True
        self.shard: WeightShard | None = None  # set when the weight is a data-parallel shard (weight_shard.py)
        self.frozen = False  # the codes stand for a weight the module no longer holds (frozen.py): never re-quantize

    def get(self, weight: torch.Tensor, spec: QuantSpec) -> Float8Blocks:
        """q(W) in ``spec``'s blocks, quantized only if ``weight`` changed since the last call."""
        key = self._key_of(weight, spec)
        if key != self._key:
            if self.frozen:
                raise RuntimeError(f"{self.name}: a frozen copy holds only the codes of this weight, but its "
                                   "placeholder was written or moved (e.g. by .to()); make the frozen copy again from "
                                   "the model (jetrl.fp8.frozen.frozen_copy) on the target device")
            old, deferred = self._weight, _deferred.pending
            # In place when the layout is unchanged: the buffers keep their addresses, so CUDA graphs
            # captured by the engine read the new version with no recapture (zero weight sync).
            shape = weight.shape if self.shard is None else self.shard.full_shape
            in_place = (old is not None and tuple(old.block) == tuple(spec.block) and old.codes.shape == shape
                        and old.codes.device == weight.device)
            self._key = None  # until the new codes are in: a failed check leaves the entry stale
            with torch.no_grad():
                if self.shard is None:
                    fresh = quantize(weight.detach(), spec.block, pow2_scale=spec.pow2_scale,
                                     check_finite=deferred is None, name=self.name, out=old if in_place else None)
                else:  # this rank's rows quantized, every rank's codes gathered (weight_shard.py)
                    fresh = self.shard.quantize(weight.detach(), spec.block, pow2_scale=spec.pow2_scale,
                                                check_finite=deferred is None, out=old if in_place else None)
            if not in_place:
                self._weight = fresh.memoize() if fresh.codes.device.type == "cpu" else fresh
            self._written(key, check=deferred is not None)
        note_weight_read(self, "W", self._weight, self.get, self.settle, weight, spec)
        return self._weight

    def settle(self, weight: torch.Tensor, spec: QuantSpec) -> None:
        """Record that the held buffers now hold q(``weight``) for its current version -- a CUDA graph that captured
        :meth:`get`'s in-place re-quantization was replayed (jetrl/fp8/refresh_graph.py) -- without quantizing: the
        host side of that :meth:`get`. Under :func:`batched_finite_check` the buffers join its one check."""
        self._written(self._key_of(weight, spec), check=_deferred.pending is not None)

    def is_current(self, weight: torch.Tensor, spec: QuantSpec) -> bool:
        """Whether the held codes are q(``weight``) for its current version (a :meth:`get` would not quantize)."""
        return self._key == self._key_of(weight, spec)

    def _written(self, key: tuple, check: bool) -> None:
        """Bookkeeping after a new version was written into ``self._weight`` (by :meth:`get`, or a replay)."""
        self._weight.forget()
        if check:
            _deferred.pending.append((self, self._weight))
        self._transposed_stale = True
        self._key = key
        self.num_quantizations += 1
        self._changed()

    def get_transposed(self, weight: torch.Tensor, spec: QuantSpec) -> Float8Blocks:
        """q(W)^T for dgrad, from the same codes as :meth:`get` (never re-quantized)."""
        quantized = self.get(weight, spec)
        if self._weight_t is None or not _is_transpose_layout(self._weight_t, quantized):
            self._weight_t = quantized.t().memoize() if quantized.codes.device.type == "cpu" else quantized.t()
        elif self._transposed_stale:
            transpose_codes(quantized.codes, out=self._weight_t.codes)
            self._weight_t.scales.copy_(quantized.scales.t())
            self._weight_t.forget()
        self._transposed_stale = False
        note_weight_read(self, "W^T", self._weight_t, self.get_transposed, self.settle_transposed, weight, spec)
        return self._weight_t

    @property
    def has_transposed(self) -> bool:
        """Whether a transposed copy is held (a dgrad read it): a full refresh rewrites it too (refresh_graph.py)."""
        return self._weight_t is not None

    def settle_transposed(self, weight: torch.Tensor, spec: QuantSpec) -> None:
        """:meth:`settle` for the transposed copy: a replay rewrote it from the current codes."""
        self._weight_t.forget()
        self._transposed_stale = False

    def adopt(self, blocks: Float8Blocks) -> None:
        """Hold the current codes in ``blocks`` instead (same values, e.g. a view of a stacked buffer
        that a :class:`~jetrl.fp8.projection_group.ProjectionGroup` owns); later versions are written
        into it in place, like any entry."""
        if self._weight is None or not _same_layout(self._weight, blocks):
            raise ValueError(f"{self.name}: can only adopt blocks of the cached weight's layout")
        self._weight = blocks  # same values: a transposed copy made from the old buffer stays valid
        self._changed()

    def prime(self, weight: torch.Tensor, spec: QuantSpec, quantized: Float8Blocks) -> None:
        """Install ``quantized`` as q(``weight``) for the weight's *current* version, without quantizing.

        Used when loading an FP8 checkpoint: the file holds the codes and scales the trainer
        used, and the master weight is set to their dequantization ``codes * scales``. Why not
        simply re-quantize that master weight? ``quantize(dequantize(q))`` is not guaranteed to
        give back ``q`` (tests/test_export.py shows both cases):

        * a BF16 master cannot hold ``448 * s`` for a scale ``s`` computed from an fp32 amax, so
          the block's new amax, hence its scale, moves in the last bits;
        * with power-of-two scales, a block whose amax rounded *down* to the code 224 re-quantizes
          with half the scale and every code doubled (same values, different bits).

        Priming makes the loaded model read the file's exact bits until the weight is next
        written (an optimizer step bumps ``weight._version``, so the entry then goes stale and
        the weight is quantized from the master as usual).

        The key is the one :meth:`get` computes, so prime *after* the last in-place write and
        device move of ``weight``. ``quantized`` is checked against ``spec`` (block shape,
        E4M3 codes of ``weight``'s shape and device, one finite fp32 scale per block, power-of-two
        scales if ``spec.pow2_scale``); a mismatch raises ``ValueError`` naming the weight.
        """
        rows, cols = weight.shape
        br, bc = spec.block
        expected_scales = (-(-rows // br), -(-cols // bc))
        problems = []
        if tuple(quantized.block) != tuple(spec.block):
            problems.append(f"block {tuple(quantized.block)} != the recipe's {spec.block}")
        if quantized.codes.dtype != E4M3:
            problems.append(f"codes dtype {quantized.codes.dtype} != {E4M3}")
        if quantized.codes.shape != weight.shape:
            problems.append(f"codes shape {tuple(quantized.codes.shape)} != weight shape {tuple(weight.shape)}")
        if quantized.scales.dtype != torch.float32 or tuple(quantized.scales.shape) != expected_scales:
            problems.append(
                f"scales {quantized.scales.dtype} {tuple(quantized.scales.shape)} != float32 {expected_scales}"
            )
        if quantized.codes.device != weight.device or quantized.scales.device != weight.device:
            problems.append(f"codes/scales on {quantized.codes.device}/{quantized.scales.device}, weight on {weight.device}")
        if problems:
            raise ValueError(f"{self.name}: cannot prime the FP8 weight cache: {'; '.join(problems)}")
        assert_finite(quantized, self.name)
        if spec.pow2_scale and bool(((quantized.scales.view(torch.int32) & 0x7FFFFF) != 0).any()):
            raise ValueError(
                f"{self.name}: the recipe uses power-of-two scales but the given scales are not powers of two; "
                "load with the recipe the checkpoint was exported with"
            )
        self._weight = quantized.memoize() if quantized.codes.device.type == "cpu" else quantized
        self._weight_t = None
        self._key = self._key_of(weight, spec)
        self._changed()

    def _changed(self) -> None:
        """The held codes or buffers changed other than by a read: the epoch moves."""
        self.epoch += 1

    @staticmethod
    def _key_of(weight: torch.Tensor, spec: QuantSpec) -> tuple:
        return (weight._version, weight.data_ptr(), weight.device, spec)

    def rekey(self, weight: torch.Tensor, spec: QuantSpec) -> None:
        """Hold the current codes as q(``weight``) for its current version: ``weight`` replaced the parameter they
        were quantized from -- this rank's rows of it (weight_shard.py), or a placeholder in a frozen copy
        (frozen.py, which also sets :attr:`frozen`)."""
        self._key = self._key_of(weight, spec)
        self._changed()

    def invalidate(self) -> None:
        """Forget the version: the next read quantizes again (into the same buffers)."""
        self._key = None
        self._changed()


def _is_transpose_layout(t: Float8Blocks, q: Float8Blocks) -> bool:
    """Whether ``t`` has the shapes, block and device of ``q.t()`` (compared without building its views: a dgrad
    asks at every backward)."""
    (rows, cols), (scale_rows, scale_cols) = q.codes.shape, q.scales.shape
    return (t.codes.shape == (cols, rows) and t.scales.shape == (scale_cols, scale_rows)
            and tuple(t.block) == tuple(q.block[::-1]) and t.codes.device == q.codes.device)


def _same_layout(a: Float8Blocks, b: Float8Blocks) -> bool:
    return (a.codes.shape == b.codes.shape and a.scales.shape == b.scales.shape and a.block == b.block
            and a.codes.device == b.codes.device)
