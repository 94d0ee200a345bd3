"""How ``jetrl bench`` measures time and bytes: CUDA events, CUDA-graph replay, the bytes floor.

Four clocks, each for a kind of work (the first two report the *median* of repeated runs):

* :func:`time_ms` -- a CUDA event pair around ``back_to_back`` calls (after ``warmup``
  untimed calls), divided by ``back_to_back``. With one call per pair, the host's launch work
  (Python, Triton's launcher: 10-40 µs) is inside the timed region; a training step enqueues
  layer after layer with the host ahead of the GPU, so (b) times 10 calls back to back,
  which hides the launch cost as training does when the GPU work per call is long enough.
  (a) reports both: the kernel under CUDA-graph replay (its target) and this eager figure.
* :func:`graph_time_us` -- decode-sized kernels. Timed one launch at a time, the host launch
  cost dominates and every kernel looks alike (design.md §3). So ``calls`` back-to-back calls
  are captured in ONE CUDA graph, the graph is replayed ``replays`` times (event-timed) and the
  per-call time is replay time / ``calls``.
* :func:`wall_s` -- whole phases with host work inside (a rollout, a training step): the host
  wall clock between two device synchronizations.
* :func:`host_and_device_ms` -- the host's own time per call while it issues calls without waiting,
  and the device's over the same calls: whether they are bound by the host rather than the GPU.

On CPU (``jetrl bench --smoke``) every clock falls back to ``time.perf_counter`` around eager
calls: the numbers exercise the code paths and are otherwise meaningless.

The bytes floor: a memory-bound step cannot run faster than the bytes it must move divided by
the bandwidth. ``HBM_BYTES_PER_S`` is the H200's *measured* copy ceiling (design.md §3:
``y.copy_(x)`` reaches ~4.3 TB/s, counting read + write), which is the achievable bandwidth,
not the 4.8 TB/s datasheet number. Section (a) re-measures the copy ceiling in each run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from jetrl.engine.cuda_graph import capturing, warm_up

HBM_BYTES_PER_S = 4.3e12  # H200 copy ceiling, bytes/s (read + written), design.md §3


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, *, iters: int, warmup: int,
            back_to_back: int = 1) -> float:
    """Median time of one ``fn()`` call in ms: CUDA events on the GPU, ``perf_counter`` on CPU."""
    if back_to_back > 1:
        return time_ms(lambda: [fn() for _ in range(back_to_back)], device, iters=iters, warmup=warmup) / back_to_back
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(max(iters, 1)):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def graph_time_us(fn: Callable[[], object], device: torch.device, *, calls: int, replays: int,
                  warmup: int = 2) -> float:
    """Per-call time in µs of ``fn`` under CUDA-graph replay (module docstring).

    ``fn`` must be capturable: no host sync, every lazy initialization (Triton compilation,
    weight caches, cuBLAS workspaces) done by the ``max(warmup, calls)`` warm-up calls, which run on
    a side stream as the CUDA-graph docs require. (A weight cache filled during capture would run
    its finite check, a host sync, and a failed capture leaves the CUDA generator unusable.) Outputs
    of the captured calls live in the graph's private memory pool and are freed with the graph. On
    CPU: ``calls`` eager calls, ``perf_counter``.
    """
    calls = max(calls, 1)
    warmup = max(warmup, calls)  # a rotating ``fn`` (bench c) meets every weight copy before capture
    if device.type != "cuda":
        return time_ms(lambda: [fn() for _ in range(calls)], device, iters=replays, warmup=min(warmup, 1)) * 1e3 / calls
    warm_up(fn, warmup, device)
    graph = torch.cuda.CUDAGraph()
    with capturing(graph):  # the cycle collector paused (jetrl/engine/cuda_graph.py)
        for _ in range(calls):
            fn()
    try:
        return time_ms(graph.replay, device, iters=replays, warmup=1) * 1e3 / calls
    finally:
        synchronize(device)
        del graph


def host_and_device_ms(fn: Callable[[], object], device: torch.device, *, calls: int) -> tuple[float, float]:
    """(host ms, device ms) per call of ``calls`` calls issued back to back without waiting, after a synchronization:
    the host's own time to issue them, and the time until the device has run them (CUDA events around the same
    calls). Where the two are about equal, the calls are host-bound: on the GPU the host enqueues and runs ahead,
    so the device waited on it (bench (b): an eager Float8Linear fwd+bwd issues ~1 ms of host work, BF16's ~0.2 ms).
    On CPU both are the same wall clock."""
    calls = max(calls, 1)
    synchronize(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) * 1e3 / calls
    if device.type != "cuda":
        return host, host
    end.record()
    end.synchronize()
    return host, start.elapsed_time(end) / calls


def wall_s(fn: Callable[[], object], device: torch.device) -> tuple[float, object]:
    """(seconds, result) of ``fn()``, between two device synchronizations (host work included)."""
    synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    return time.perf_counter() - t0, out


def floor_ms(num_bytes: float) -> float:
    """The bytes floor in ms: ``num_bytes`` moved at the measured HBM copy ceiling."""
    return num_bytes / HBM_BYTES_PER_S * 1e3


def tb_per_s(num_bytes: float, ms: float) -> float:
    """Effective bandwidth in TB/s of moving ``num_bytes`` (read + written) in ``ms``."""
    return num_bytes / (ms * 1e-3) / 1e12


def allocator_mark(device: torch.device) -> dict[str, float]:
    """The caching allocator's counters now, with the peak reset (for :func:`allocator_since`)."""
    if device.type != "cuda":
        return {}
    torch.cuda.reset_peak_memory_stats(device)
    stats = torch.cuda.memory_stats(device)
    return {"num_alloc_retries": stats.get("num_alloc_retries", 0)}


def allocator_since(mark: dict[str, float], device: torch.device) -> dict[str, float]:
    """Peak GiB allocated and reserved since ``mark``, and how often the allocator had to free its cache
    and retry (``num_alloc_retries``: each one synchronizes the device and returns cached blocks to CUDA,
    the cost of running near the memory limit)."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {"peak_allocated_gib": round(stats["allocated_bytes.all.peak"] / 2**30, 1),
            "peak_reserved_gib": round(stats["reserved_bytes.all.peak"] / 2**30, 1),
            "alloc_retries": stats.get("num_alloc_retries", 0) - mark.get("num_alloc_retries", 0)}


def kernel_kind(name: str, kinds: tuple[tuple[str, tuple[str, ...]], ...]) -> str:
    """The first ``kind`` of ``kinds`` = ((kind, substrings), ...) one of whose substrings is in the kernel name
    (case-insensitive), else "other": how the profiling scripts in bench/ group GPU time by kernel kind."""
    low = name.lower()
    return next((kind for kind, keys in kinds if any(k in low for k in keys)), "other")
