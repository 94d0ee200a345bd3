"""After an optimizer step, every FP8 weight buffer of a model re-quantized by one CUDA-graph replay.

Why: an optimizer step changes every trained weight, and every FP8 buffer a reader holds must then be rewritten for
the new version (weight_cache.py): a layer's 128x128 codes and scales (W), the transposed copy its dgrad reads
(W^T), a projection group's stacked W_s^T. Eagerly that is a few launches per weight and tens of µs of host time
each: the refresh and the transposes that follow it took 24.4 ms of wall time at Qwen3-0.6B's 196 weights and 45.5 ms
at the 8B's 252, far above their GPU work, while the GPU waits; replayed from a graph, 3.9 and 15.9 ms
(bench/time_weight_refresh.py, run FI). Where the GPU is still busy with the optimizer step (the 8B's AdamW) the
eager host time hid behind it; where it is not (small models), it was the FP8 update's gap to BF16
(docs/benchmarks.md (f)).

How: every rewrite goes into the same buffers, at the same addresses, whatever the version (weight_cache.py), so a
graph that captured the rewrites stays valid across versions. The capture runs the eager refresh -- each FP8
linear's W (through its group's stacked buffer, where it has one), then the transposed copies that exist -- inside
the capture, while every weight is stale, under :func:`~jetrl.fp8.weight_cache.recorded_weight_reads`: the kernels
are recorded, the host bookkeeping runs once, and the log lists every buffer touched as
:class:`~jetrl.fp8.weight_cache.WeightRead` entries. Each later refresh replays the kernels, then each entry's
``settle()`` does what its read would have done on the host (the cache's version key, its transposed copy's flag,
W_s^T's version), in the order first read (a weight before its transposes). The finiteness check is the usual one
for a whole refresh: :func:`~jetrl.fp8.weight_cache.batched_finite_check`, one device sync, raising
:class:`~jetrl.fp8.quant.NonFiniteError` with the non-finite weights named and their entries stale.

When it replays: only in the state it captured -- the same weight tensors at the same addresses, none of their caches
touched since its last replay other than by a read (each cache's ``epoch``: no prime, eager re-quantization,
invalidation; other models' caches do not matter), and every weight stale (an optimizer step updated all of them).
Otherwise the refresh is the eager ``refresh_weight_caches``, and the next full refresh captures anew. The graph
serves FP8 linear layers whose rollout and training read one weight spec (every shipped recipe's), on CUDA;
``JETRL_REFRESH_GRAPH=0`` (read when the refresh is built) keeps it eager.

Numerics: the replay runs the eager refresh's kernels on the same inputs, so the codes and scales are its bits
(tests/test_refresh_graph.py compares them; tests/test_train_graphs.py the graphed trainer's weights with the eager
trainer's).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from jetrl.fp8.convert import float8_modules, refresh_weight_caches
from jetrl.fp8.linear import Float8Linear
from jetrl.fp8.recipe import QuantSpec
from jetrl.fp8.weight_cache import WeightRead, batched_finite_check, recorded_weight_reads
from jetrl.overrides import env_choice

ENV = "JETRL_REFRESH_GRAPH"


class WeightRefresh:
    """``refresh()`` after each optimizer step: every FP8 weight buffer of ``model`` brought up to date for the new
    version, by one graph replay where it can (module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.graphed = env_choice(ENV, ("0", "1"), "1 = replay the FP8 weight refresh from a CUDA graph on CUDA, 0 = "
                                  "eager") != "0"
        self._graph: torch.cuda.CUDAGraph | None = None
        self._entries: dict[tuple, WeightRead] = {}
        self._state: tuple | None = None  # the weights' ids and addresses at capture
        self._epochs: tuple | None = None  # their caches' epochs right after the last capture or replay
        self.problem: str | None = None  # why capturing failed (then it is never tried again)
        self.num_captures = 0
        self.num_replays = 0

    def refresh(self) -> bool:
        """Bring every FP8 weight buffer up to date; True if by the graph, whose buffers are then :attr:`keys`."""
        if self.graphed and self.problem is None and self._refresh_graphed():
            return True
        refresh_weight_caches(self.model)
        return False

    @property
    def keys(self) -> frozenset:
        """The ``recorded_weight_reads`` keys of the buffers the graph brings up to date (none before a capture)."""
        return frozenset(self._entries)

    def _refresh_graphed(self) -> bool:
        layers = _graphable(self.model)
        if not layers or any(m.weight_cache.is_current(m.weight, spec) for m, spec in layers):
            return False
        state = tuple((id(m.weight), m.weight.data_ptr()) for m, _ in layers)
        if self._graph is not None and (state != self._state or _epochs(layers) != self._epochs):
            self.drop()
        with torch.no_grad(), batched_finite_check():
            if self._graph is None:
                if not self._capture(layers, state):
                    return False
            else:
                self._graph.replay()
                for entry in self._entries.values():
                    entry.settle()
                self.num_replays += 1
        self._epochs = _epochs(layers)
        return True

    def _capture(self, layers: list[tuple[Float8Linear, QuantSpec]], state: tuple) -> bool:
        from jetrl.engine.cuda_graph import capturing

        graph = torch.cuda.CUDAGraph()
        try:
            with recorded_weight_reads() as reads, capturing(graph):
                _read_all(layers)
        except Exception as error:  # noqa: BLE001 -- the eager refresh takes over, and says why once
            for module, _ in layers:  # their host logic ran, their kernels did not: stale again
                module.weight_cache.invalidate()
            self.problem = f"{type(error).__name__}: {error}"
            warnings.warn(f"the FP8 weight refresh could not be captured in a CUDA graph ({self.problem}); it runs "
                          "eagerly from now on", stacklevel=4)
            return False
        graph.replay()
        self._graph, self._entries, self._state = graph, dict(reads), state
        self.num_captures += 1
        return True

    def drop(self) -> None:
        """Forget the captured graph (the next full refresh captures again)."""
        if self._graph is not None:
            torch.cuda.synchronize()  # no replay may still be in flight when its graph is freed
        self._graph, self._entries, self._state, self._epochs = None, {}, None, None


def _graphable(model: nn.Module) -> list[tuple[Float8Linear, QuantSpec]] | None:
    """(layer, weight spec) of every FP8-weight layer of ``model``, or None where a graph cannot serve: a layer off
    CUDA, or one whose rollout and training read different weight specs (each read would re-quantize), or a sharded
    one (jetrl/fp8/weight_shard.py)."""
    layers = []
    for module in float8_modules(model).values():
        recipe = module.recipe
        spec = recipe.rollout.weight or recipe.train.weight
        if spec is None:
            continue
        sharded = module.weight_cache.shard is not None  # its refresh is an all-gather: eager
        if not module.weight.is_cuda or recipe.train.weight not in (None, spec) or sharded:
            return None
        layers.append((module, spec))
    return layers


def _read_all(layers: list[tuple[Float8Linear, QuantSpec]]) -> None:
    """The eager refresh, transposed copies included: every layer's W (``quantized_weight``: through its group's
    stacked buffer where it has one), its W^T if it holds one, then each group's W_s^T if it holds one."""
    groups = {}
    for module, spec in layers:
        module.quantized_weight()
        if module.weight_cache.has_transposed:
            module.weight_cache.get_transposed(module.weight, spec)
        group = module.projection_group
        if group is not None and group.has_stacked_t:
            groups[id(group)] = (group, spec)
    for group, spec in groups.values():
        group.stacked_weight_t(spec)


def _epochs(layers: list[tuple[Float8Linear, QuantSpec]]) -> tuple:
    return tuple(m.weight_cache.epoch for m, _ in layers)
