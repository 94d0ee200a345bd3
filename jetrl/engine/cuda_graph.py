"""CUDA-graph capture and replay of the engine's decode forward, one graph per batch-size bucket.

Why: a decode step of a small model is a few hundred tiny kernels; launched one by one from
Python the launch overhead (~25 µs host time per op-group, design.md §5) dominates, and HF
``generate`` lands 20-25x off the bytes floor for that reason. A CUDA graph replays the whole
forward with one launch.

What makes the decode forward capturable (the engine guarantees it, this file relies on it):
* ``step(num_rows)`` reads only *persistent* tensors -- the KV cache, the per-slot lengths and
  pending tokens -- through fixed views of slots [0, num_rows). Those are the graph's static
  inputs: the engine updates them in place between replays, never reallocates them.
* No host sync inside (no ``.item()``, no boolean-mask indexing, no CPU tensors), and every
  lazily initialized state (RoPE tables on the device, FP8 weight caches) is filled by the
  warmup runs before capture.
* It returns a fresh (num_rows, vocab) logits tensor in the model dtype; captured, that tensor lives
  in the graph's private pool and every replay overwrites it. The engine consumes it (sampling, which
  stays outside the graph) before the next replay.

Staleness: a graph bakes in the addresses of the weights and of the FP8 weight-cache codes it
read during capture. In-place updates of BF16 weights (``optimizer.step()``) are seen by the
next replay; a *new* FP8 code tensor (re-quantization after an update) or a moved parameter
is not. The engine therefore calls :meth:`reset` whenever its weight fingerprint changes
(engine.py) and keeps the captured code tensors alive until then.

Buckets: 1, 2, 4, 8, then multiples of 16 up to ``max_rows`` (nano-vllm's choice): a step over
``B`` active rows replays the smallest bucket >= B; the extra rows are empty slots whose
results are ignored. Graphs share one memory pool and are captured lazily, on first use.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator

import torch
from torch import Tensor


@contextlib.contextmanager
def capturing(graph: torch.cuda.CUDAGraph, pool=None) -> Iterator[None]:
    """``torch.cuda.graph(graph, pool=pool)`` with Python's cycle collector paused from before the capture begins
    until after it ends. Why: a CUDA graph freed while another is being captured invalidates that capture
    ("operation not permitted when stream is capturing"), and the collector may run at any allocation and free an
    unreachable object holding a graph (an engine and its :class:`DecodeGraphs` form a reference cycle). Seen on the
    H200 when one process built several trainers in a row (tests/test_train_graphs.py, run EP). Unreachable objects
    are collected later, outside any capture."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            yield
    finally:
        if enabled:
            gc.enable()


def warm_up(fn: Callable[[], object], times: int, device: torch.device | None = None) -> None:
    """Run ``fn`` ``times`` times on a side stream, ordered after and before the current stream's work: what CUDA
    graph capture asks for first (lazy initialization, cuBLAS workspaces, Triton compilation, the allocator)."""
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        for _ in range(times):
            fn()
    current.wait_stream(side)


def default_buckets(max_rows: int) -> list[int]:
    small = [b for b in (1, 2, 4, 8) if b < max_rows]
    return sorted({*small, *range(16, max_rows, 16), max_rows})


class DecodeGraphs:
    """Lazily captured CUDA graphs of ``step(bucket) -> logits`` for each bucket."""

    def __init__(
        self, step: Callable[[int], Tensor], max_rows: int, buckets: list[int] | None = None, num_warmup: int = 2
    ) -> None:
        self.step, self.num_warmup = step, num_warmup
        self.buckets = sorted(buckets) if buckets else default_buckets(max_rows)
        if self.buckets[-1] < max_rows:
            raise ValueError(f"CUDA graph buckets {self.buckets} must cover max_rows={max_rows}")
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self._pool = None
        self.num_captures = 0
        self.num_replays = 0

    def bucket(self, num_rows: int) -> int:
        return next(b for b in self.buckets if b >= num_rows)

    def __call__(self, num_rows: int) -> Tensor:
        """Run the decode forward over the bucket that holds ``num_rows``; (bucket, V) logits."""
        b = self.bucket(num_rows)
        if b not in self._graphs:
            self._capture(b)
        graph, logits = self._graphs[b]
        graph.replay()
        self.num_replays += 1
        return logits

    def _capture(self, b: int) -> None:
        # Warm up, then capture into the shared pool. The warmup runs really execute: they
        # rewrite each row's pending-token K/V at position lengths[s], which is exactly what the
        # next real step writes there, so the cache stays correct.
        warm_up(lambda: self.step(b), self.num_warmup)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with capturing(graph, self._pool):
            logits = self.step(b)
        self._graphs[b] = (graph, logits)
        self.num_captures += 1

    def reset(self) -> None:
        """Drop every graph (weights moved or were re-quantized); the next call recaptures."""
        if self._graphs:
            torch.cuda.synchronize()  # no replay may still be in flight when its graph is freed
        self._graphs.clear()
        self._pool = None
