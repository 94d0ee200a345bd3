"""Decode and mid-M (M <= 256) W8A8 block-FP8 GEMM for Hopper in Gluon; its spec is
:func:`jetrl.fp8.gemm.gemm_emulated`.

Why: at the rollout's batch (M = 256 rows against an 8B layer) cuBLAS's block-scaled kernel tiles
the output 128 x 128, so o and down run 64 CTAs and qkv 96 on 132 SMs (docs/benchmarks.md (c):
112 µs per layer against a 45 µs weight-bytes floor), and the Triton kernel of gemm_triton.py
reaches half of cuBLAS's tensor-core rate there: Triton waits on every ``wgmma`` before the
per-group rescale, so the tensor cores idle while the CUDA cores rescale. Gluon (Triton's
lower-level dialect) lets this kernel say what overlaps with what.

Math, for a[M, K] in 1x128 groups (scales sa[M, K/128]) and b[N, K] in 128x128 blocks (scales
sb[N/128, K/128]), as in gemm_triton.py:

    out[m, n] = sum_g  sa[m, g] * sb[n // 128, g] * P_g[m, n],   P_g = sum_{k in group g} a[m, k] b[n, k]

Structure (persistent: min(tiles, SMs) CTAs, each taking BLOCK_M x BLOCK_N output tiles in turn,
numbered M-first so that the CTAs sharing a weight tile run together; BLOCK_N <= 128 so that a tile
has one weight scale per group):

* a 1-warp **producer** partition streams the A and B tiles of each group into a ring of
  ``stages`` shared-memory slots with TMA (``ready`` barriers carry the byte counts; ``empty``
  barriers hand slots back);
* each **consumer** warpgroup (64 rows of the tile; one, or two in partitions of their own) takes
  groups in runs of 2 or 4, alternating two fp32 tiles P: it issues the next group's FP8 ``wgmma``,
  waits for the previous group only, and rescales that one into the accumulator while the tensor
  cores run the next. A run leaves nothing in flight at the loop's back edge: an in-flight ``wgmma``
  carried around the loop makes ptxas serialize all of them (C7514, "non wgmma instructions reading
  accumulator registers"). With two consumer partitions each waits only on its own ``wgmma``, so one
  rescales while the other's run.
* while a tile's output is stored, the producer already loads the next tile's groups.

The products inside a group are exact and summed by the tensor cores in their fp32 (as cuBLAS's
block-scaled path does, promoting every 128 of K), so results agree with the emulation to the same
~1e-3 relative, not bitwise. But a row's bits depend on nothing else: every element adds its groups in order
into one accumulator whatever the tile, the unroll, the partitions or PDL, so rows of a 1-row call equal those of a
9216-row call under any two configurations (bench/probe_gluon_invariance.py, run DH), and exact mode
(jetrl/exact.py) runs it batch-invariant at the fastest tile per shape. K must be a multiple of 256 (pairs of
groups) and TMA must be able to read the codes (gluon_tiles.operand_problem); the dispatcher in gemm.py sends the
rest elsewhere. Tiles are a function of the shape only (``gluon_tiles`` in gemm.py).

Needs Triton >= 3.6 with Gluon and an SM90 GPU; imported lazily (CPU tests compile it for sm_90
with Triton's bundled ptxas and check the loop's SASS: see tests/test_gemm_gluon.py).
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from jetrl.fp8.kernels import pdl as _pdl
from jetrl.fp8.kernels import sm_count
from jetrl.fp8.kernels.gluon_tiles import GROUP, GluonConfig, operand_problem

_G = gl.constexpr(GROUP)  # the same inside kernels


@gluon.jit
def _tile_origin(t, M, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Output tile t's first row and column. Tiles are numbered M-first, so the CTAs that share a weight
    tile run side by side (one HBM read of it, the rest from L2)."""
    m_tiles = gl.cdiv(M, BLOCK_M)
    return (t % m_tiles) * BLOCK_M, (t // m_tiles) * BLOCK_N


@gluon.jit
def _producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, num_tiles, num_k,
              STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, PDL: gl.constexpr):
    early = 0  # groups of the first tile whose weight load is issued before the dependency wait
    if PDL:
        # The weight is written by no kernel in flight (pdl.py), so the first tile's weight groups fill the ring
        # while the kernel before this one still runs; the activations are loaded only after griddepcontrol.wait.
        _, first_n = _tile_origin(gl.program_id(0), M, BLOCK_M, BLOCK_N)
        early = gl.minimum(num_k, STAGES)
        for s in range(early):
            mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(b_desc, [first_n, s * _G], ready.index(s), b_bufs.index(s))
        gdc_wait()
        gdc_launch_dependents()
    c = 0  # groups loaded so far: slot c % STAGES, its (c // STAGES)-th use
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_m, off_n = _tile_origin(t, M, BLOCK_M, BLOCK_N)
        for g in range(num_k):
            s = c % STAGES
            # a slot's first use passes at once: a fresh barrier counts as having completed phase "1"
            mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
            if c >= early:  # the first tile's first groups' weight loads were issued before the wait (PDL)
                mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(b_desc, [off_n, g * _G], ready.index(s), b_bufs.index(s))
            tma.async_copy_global_to_shared(a_desc, [off_m, g * _G], ready.index(s), a_bufs.index(s))
            c += 1


@gluon.jit
def _issue(a_bufs, b_bufs, ready, c, tile, WG: gl.constexpr, STAGES: gl.constexpr):
    """Start the FP8 wgmma of the c-th loaded group for this warpgroup's 64 rows (async), overwriting
    ``tile`` (a retired tile whose registers it reuses: use_acc=False ignores its values)."""
    s = c % STAGES
    mbarrier.wait(ready.index(s), (c // STAGES) & 1)
    a = a_bufs.index(s).slice(WG * 64, 64, dim=0)
    return warpgroup_mma(a, b_bufs.index(s).permute((1, 0)), tile, use_acc=False, is_async=True)


@gluon.jit
def _retire(p, acc, empty, c, g, sa_rows, row_ok, sb_tile, stride_sak, OUTSTANDING: gl.constexpr,
            STAGES: gl.constexpr):
    """Wait for the c-th loaded group (group g of its tile), leaving OUTSTANDING later ones in flight,
    free its slot, and rescale it into acc."""
    sa = gl.load(sa_rows + g * stride_sak, mask=row_ok, other=0.0)
    sb = gl.load(sb_tile + g)
    p = warpgroup_mma_wait(num_outstanding=OUTSTANDING, deps=(p,))
    mbarrier.arrive(empty.index(c % STAGES), count=1)
    return acc + p * (sa * sb)[:, None], p


@gluon.jit
def _consumer(a_bufs, b_bufs, ready, empty, sa_ptr, sb_ptr, out_ptr, M, N, num_tiles, num_k,
              stride_sam, stride_sak, stride_sbn, stride_om,
              WG: gl.constexpr, UNROLL: gl.constexpr, STAGES: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, PDL: gl.constexpr):
    """One warpgroup: rows [64 WG, + 64) of each of the CTA's tiles, groups in runs of UNROLL (2 or 4).

    Within a run two tiles alternate: group j+1's wgmma runs while group j is rescaled, so only the
    run's last rescale leaves the tensor cores to the other warpgroup; no wgmma is in flight across
    the loop's back edge (ptxas would serialize them all). While a tile's output is stored, the
    producer already loads the next tile's groups.
    """
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, BLOCK_N, 32])
    ta = gl.zeros([64, BLOCK_N], gl.float32, layout)
    tb = gl.zeros([64, BLOCK_N], gl.float32, layout)
    if PDL:  # the activation scales come from the kernel before this one
        gdc_wait()
        gdc_launch_dependents()
    c = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_m, off_n = _tile_origin(t, M, BLOCK_M, BLOCK_N)
        rows = off_m + WG * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
        row_ok = rows < M
        sa_rows = sa_ptr + rows * stride_sam
        sb_tile = sb_ptr + (off_n // _G) * stride_sbn
        acc = gl.zeros([64, BLOCK_N], gl.float32, layout)
        for g in range(0, num_k, UNROLL):
            pa = _issue(a_bufs, b_bufs, ready, c, ta, WG, STAGES)
            pb = _issue(a_bufs, b_bufs, ready, c + 1, tb, WG, STAGES)
            if UNROLL == 4:
                acc, ta = _retire(pa, acc, empty, c, g, sa_rows, row_ok, sb_tile, stride_sak, 1, STAGES)
                pa = _issue(a_bufs, b_bufs, ready, c + 2, ta, WG, STAGES)
                acc, tb = _retire(pb, acc, empty, c + 1, g + 1, sa_rows, row_ok, sb_tile, stride_sak, 1, STAGES)
                pb = _issue(a_bufs, b_bufs, ready, c + 3, tb, WG, STAGES)
                acc, ta = _retire(pa, acc, empty, c + 2, g + 2, sa_rows, row_ok, sb_tile, stride_sak, 1, STAGES)
                acc, tb = _retire(pb, acc, empty, c + 3, g + 3, sa_rows, row_ok, sb_tile, stride_sak, 0, STAGES)
            else:
                acc, ta = _retire(pa, acc, empty, c, g, sa_rows, row_ok, sb_tile, stride_sak, 1, STAGES)
                acc, tb = _retire(pb, acc, empty, c + 1, g + 1, sa_rows, row_ok, sb_tile, stride_sak, 0, STAGES)
            c += UNROLL
        cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        out = out_ptr + rows[:, None] * stride_om + cols[None, :]
        gl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols < N)[None, :])


@gluon.jit
def _gemm_kernel(a_desc, b_desc, sa_ptr, sb_ptr, out_ptr, M, N, K, stride_sam, stride_sak, stride_sbn, stride_om,
                 STAGES: gl.constexpr, UNROLL: gl.constexpr, num_warps: gl.constexpr, PDL: gl.constexpr = False):
    """Persistent: CTA i computes tiles i, i + grid, i + 2 grid, ... (one tile each when they fit one wave)."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    WARPGROUPS: gl.constexpr = BLOCK_M // 64
    num_tiles = gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N)
    num_k = gl.cdiv(K, _G)
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, _G], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, _G], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=WARPGROUPS)  # a slot is free once every warpgroup is done with it
    if WARPGROUPS == 2:  # two consumer partitions: each waits on its own wgmma, so they interleave
        gl.warp_specialize([
            (_consumer, (a_bufs, b_bufs, ready, empty, sa_ptr, sb_ptr, out_ptr, M, N, num_tiles, num_k,
                         stride_sam, stride_sak, stride_sbn, stride_om, 0, UNROLL, STAGES, BLOCK_M, BLOCK_N, PDL)),
            (_consumer, (a_bufs, b_bufs, ready, empty, sa_ptr, sb_ptr, out_ptr, M, N, num_tiles, num_k,
                         stride_sam, stride_sak, stride_sbn, stride_om, 1, UNROLL, STAGES, BLOCK_M, BLOCK_N, PDL)),
            (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, num_tiles, num_k, STAGES, BLOCK_M,
                         BLOCK_N, PDL)),
        ], [4, 1], [224, 24])
    else:
        gl.warp_specialize([
            (_consumer, (a_bufs, b_bufs, ready, empty, sa_ptr, sb_ptr, out_ptr, M, N, num_tiles, num_k,
                         stride_sam, stride_sak, stride_sbn, stride_om, 0, UNROLL, STAGES, BLOCK_M, BLOCK_N, PDL)),
            (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, num_tiles, num_k, STAGES, BLOCK_M,
                         BLOCK_N, PDL)),
        ], [1], [24])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))


@functools.cache
def _box_layout(rows: int):
    return gl.NVMMASharedLayout.get_default_for([rows, GROUP], gl.float8e4nv)


def descriptors(a_codes: torch.Tensor, b_codes: torch.Tensor, cfg: GluonConfig) -> tuple:
    """TMA descriptors of the (M, K) activation and (N, K) weight codes, one group of K per box. Built per call:
    a descriptor holds its tensor, so a cache of them keyed by tensor kept every eager call's activation codes
    alive (an eager decode or a short prefill leaked one per GEMM); a CUDA graph captures them by value."""
    def desc(t, rows):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), [rows, GROUP], _box_layout(rows))

    return desc(a_codes, cfg.block_m), desc(b_codes, cfg.block_n)


def gemm_mid_m(a_codes: torch.Tensor, a_scales: torch.Tensor, b_codes: torch.Tensor, b_scales: torch.Tensor,
               out_dtype: torch.dtype = torch.bfloat16, config: GluonConfig | None = None, *,
               pdl: bool | None = None) -> torch.Tensor:
    """out[M, N] = deq(a) @ deq(b)^T for a (M, K) 1x128 and b (N, K) 128x128 (row-major codes), K % 256 == 0.

    ``pdl``: launch with programmatic dependent launch (kernels/pdl.py; the weight's first groups are loaded
    before the kernel waits for the one before it); None = where ``pdl_enabled`` says so, up to ``PDL_MAX_M`` rows."""
    m, k = a_codes.shape
    n = b_codes.shape[0]
    assert b_codes.shape[1] == k, (a_codes.shape, b_codes.shape)
    problem = operand_problem(a_codes, b_codes)
    if problem:
        raise ValueError(f"gemm_mid_m: {problem}")
    assert a_scales.shape == (m, k // GROUP) and b_scales.shape == (-(-n // GROUP), k // GROUP)
    assert b_scales.stride(1) == 1
    if config is None:  # the dispatcher's tiles for this shape
        from jetrl.fp8.gemm import gluon_tiles

        config = gluon_tiles(m, n, k)
    cfg = config
    out = torch.empty((m, n), dtype=out_dtype, device=a_codes.device)
    if m == 0:  # no tile, no launch
        return out
    a_desc, b_desc = descriptors(a_codes, b_codes, cfg)
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    grid = (min(tiles, sm_count(a_codes.device)),)
    unroll = cfg.unroll if k % (cfg.unroll * GROUP) == 0 else 2
    if pdl is None:  # the rule by which the kernel writing its input releases early
        pdl = _pdl.release_rows(a_codes.device, m)
    _gemm_kernel[grid](a_desc, b_desc, a_scales, b_scales, out, m, n, k, a_scales.stride(0), a_scales.stride(1),
                       b_scales.stride(0), out.stride(0), STAGES=cfg.stages, UNROLL=unroll, num_warps=4,
                       **({"PDL": True, "launch_pdl": True} if pdl else {}))
    return out
