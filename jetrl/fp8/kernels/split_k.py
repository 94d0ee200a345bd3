"""Deterministic split-K: the fp32 partial tiles of a GEMM's K splits summed in split order, in the kernel itself.

Why: a decode-sized GEMM has few output tiles (an 8B layer's o projection at 64 rows: 32 tiles of 64 x 128 for 132
SMs), so one program per tile leaves most of the GPU idle while each streams a whole K-long slice of the weight.
Splitting K gives every tile several programs. Atomic accumulation would make the sum's order (and the bits) depend
on which split finishes first, so instead:

* every split writes its fp32 partial tile to a workspace ``work[split]`` and bumps the tile's arrival counter;
* the split that arrives last reads the partials back and sums them in split order (``0 + p_0 + p_1 + ...``),
  writes the output and resets the counter to 0 for the next call.

One launch, no memset per call (CUDA-graph safe), the same bits run to run. The counters are one fixed buffer per
device that the kernels keep zero themselves, so split-K calls must not overlap on two streams of one device (jetrl
runs its GEMMs on one stream).

Two forms:

* :func:`store_tile` -- the split count is a compile-time constant (the small-M kernel, gemm_triton.py);
* :func:`merge_splits` -- a tile's program count is a runtime value, 1 or the kernel's number of K splits ``S``. A
  single program walks all ``S`` splits itself, each from a zero accumulator, and sums them in split order in
  registers (``0 + acc_0 + acc_1 + ...``): the same additions on the same values as the last arrival's merge. So the
  bits are the same whether a tile runs as one program or as ``S``, and the choice can follow the problem size
  (:func:`programs_per_tile`) without changing the result: exact mode's batch-invariant GEMMs (gemm_exact_triton.py,
  models/kernels/exact_linear_triton.py) split a decode step's GEMM across the GPU and run the trainer's in one
  program per tile, in one binary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetrl.fp8.kernels import sm_count

MAX_TILES = 65536  # counters per device, shared by every split-K kernel: the most output tiles a split call may have
_counters: dict[torch.device, torch.Tensor] = {}


def tile_counters(device: torch.device) -> torch.Tensor:
    """The device's zeroed int32 arrival counters, one per output tile, kept zero by the kernels themselves.

    One fixed buffer per device, allocated on the first split-K call and never replaced (captured CUDA graphs keep
    pointing at it). It is shared by all calls, so split-K GEMMs must not run concurrently on two streams of one
    device.
    """
    buf = _counters.get(device)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "split-K GEMM: the arrival counters are allocated on the first call, which must not be inside "
                "CUDA-graph capture; run the GEMM once (a warm-up) before capturing"
            )
        buf = _counters[device] = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
    return buf


@triton.jit
def _arrive(part, work, tile_mask, count_ptr, pid_k, tile_elems):
    """Write this split's partial tile and bump the tile's counter: how many splits had arrived before it. The
    barriers make the whole CTA's partial stores precede the (acq_rel) bump, and the bump precede every thread's
    reads of the other partials."""
    tl.store(work + pid_k * tile_elems, part, mask=tile_mask)
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel")
    tl.debug_barrier()
    return arrived


@triton.jit
def _sum_partials(like, work, tile_mask, count_ptr, tile_elems, splits):
    """``0 + p_0 + p_1 + ...`` over the ``splits`` partial tiles (read past L1: .cg), and the counter reset."""
    total = tl.zeros_like(like)
    s = 0
    while s < splits:  # a while loop: the interpreter's range() cannot take a runtime bound
        total += tl.load(work + s * tile_elems, mask=tile_mask, other=0.0, cache_modifier=".cg")
        s += 1
    tl.atomic_xchg(count_ptr, 0)
    return total


@triton.jit
def store_tile(acc, out, work, tile_mask, count_ptr, pid_k, tile_elems, SPLIT_K: tl.constexpr):
    """Write a program's fp32 tile ``acc`` to ``out`` (pointers of the tile), or with ``SPLIT_K > 1`` sum the
    splits' partial tiles (module docstring): the last split to arrive writes the output."""
    if SPLIT_K == 1:
        tl.store(out, acc.to(out.dtype.element_ty), mask=tile_mask)
    else:
        arrived = _arrive(acc, work, tile_mask, count_ptr, pid_k, tile_elems)
        if arrived == SPLIT_K - 1:
            tl.store(out, _sum_partials(acc, work, tile_mask, count_ptr, tile_elems, SPLIT_K).to(out.dtype.element_ty),
                     mask=tile_mask)


@triton.jit
def merge_splits(part, work, tile_mask, count_ptr, pid_k, tile_elems, programs_k):
    """The tile's total and whether this program writes it, for ``programs_k`` (runtime) programs per tile: with
    one, ``part`` is already the in-register sum of every split, written by this program; with several, ``part``
    is split ``pid_k``'s, and the last to arrive sums them (module docstring)."""
    total, last = part, programs_k == 1
    if programs_k != 1:
        arrived = _arrive(part, work, tile_mask, count_ptr, pid_k, tile_elems)
        last = arrived == programs_k - 1
        if last:
            total = _sum_partials(part, work, tile_mask, count_ptr, tile_elems, programs_k)
    return total, last


def k_splits(k_steps: int, splits: int) -> tuple[int, int]:
    """(splits, steps per split) for a K walk of ``k_steps`` steps cut into at most ``splits`` runs of equal length
    (the last may be short): a function of the layer's K only, so part of its arithmetic."""
    if k_steps <= 0:  # K = 0: one empty run (the output is 0, plus a bias)
        return 1, 1
    n = min(splits, k_steps)
    per = triton.cdiv(k_steps, n)
    return triton.cdiv(k_steps, per), per


def programs_per_tile(tiles: int, splits: int, device: torch.device) -> int:
    """1 or ``splits``: split a GEMM's K across programs where its output tiles would fill at most half the SMs (a
    decode step's narrow layers), else one program per tile. Either gives the same bits (:func:`merge_splits`), so
    this is a speed rule only; it needs a counter per tile."""
    if splits == 1 or device.type != "cuda" or 2 * tiles > sm_count(device):
        return 1
    return splits


def split_buffers(tiles: int, splits: int, m: int, n: int, device: torch.device,
                  programs_k: int | None = None) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(programs per tile, fp32 workspace, int32 counters) for a :func:`merge_splits` kernel's launch over ``tiles``
    (m, n)-output tiles. ``programs_k`` (1 or ``splits``; default :func:`programs_per_tile`) changes only the speed.
    The workspace is a stand-in when unused: every call passes an fp32 and an int32 buffer, so every call's
    signature, hence its binary, is the same. The counters are allocated on the first call, outside graph capture."""
    if programs_k is None:
        programs_k = programs_per_tile(tiles, splits, device)
    if programs_k not in (1, splits) or (programs_k > 1 and (tiles > MAX_TILES or programs_k * m * n >= 2**31)):
        raise ValueError(f"programs_k must be 1 or this layer's {splits} K splits (the latter for at most {MAX_TILES} "
                         f"output tiles and a workspace of fewer than 2**31 elements: the kernels' offsets are 32-bit), "
                         f"got {programs_k} for {tiles} tiles of an ({m}, {n}) output")
    work = torch.empty((programs_k, m, n) if programs_k > 1 else (1,), dtype=torch.float32, device=device)
    return programs_k, work, tile_counters(device)
