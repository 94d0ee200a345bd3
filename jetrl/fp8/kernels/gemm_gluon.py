"""Mid-M (M = 65-256) W8A8 block-FP8 GEMM for Hopper in Gluon; its spec is :func:`jetrl.fp8.gemm.gemm_emulated`.

Why: at the rollout's batch (M = 256 rows against an 8B layer) cuBLAS's block-scaled kernel tiles
the output 128 x 128, so o and down run 64 CTAs and qkv 96 on 132 SMs (docs/benchmarks.md (c):
112 µs per layer against a 45 µs weight-bytes floor), and the Triton kernel of gemm_triton.py
reaches half of cuBLAS's tensor-core rate there: Triton waits on every ``wgmma`` before the
per-group rescale, so the tensor cores idle while the CUDA cores rescale. Gluon (Triton's
lower-level dialect) lets this kernel say what overlaps with what.

Math, for a[M, K] in 1x128 groups (scales sa[M, K/128]) and b[N, K] in 128x128 blocks (scales
sb[N/128, K/128]), as in gemm_triton.py:

    out[m, n] = sum_g  sa[m, g] * sb[n // 128, g] * P_g[m, n],   P_g = sum_{k in group g} a[m, k] b[n, k]

Structure (one CTA per BLOCK_M x BLOCK_N output tile, BLOCK_N <= 128 so that a tile has one
weight scale per group):

* a 1-warp **producer** partition streams the A and B tiles of each group into a ring of
  ``stages`` shared-memory slots with TMA (``ready`` barriers carry the byte counts; ``empty``
  barriers hand slots back);
* the **consumer** (the default partition, one or two warpgroups) takes groups in pairs: it issues
  the two groups' FP8 ``wgmma`` (each into a fresh fp32 tile P), waits for the first only, rescales
  it into the accumulator while the tensor cores run the second, then waits for and rescales the
  second. Pairs keep every in-flight accumulator inside one loop iteration: an in-flight ``wgmma``
  carried around the loop makes ptxas serialize all of them (C7514, "non wgmma instructions
  reading accumulator registers"), which a one-group-at-a-time loop cannot avoid either.

The products inside a group are exact and summed by the tensor cores in their fp32 (as cuBLAS's
block-scaled path does, promoting every 128 of K), so results agree with the emulation to the same
~1e-3 relative, not bitwise. K must be a multiple of 256 (pairs of groups): :func:`supports` says
which shapes this kernel takes; the dispatcher in gemm.py sends the rest elsewhere. Tiles are a
function of the shape only (:func:`gluon_config`), so a shape always sums in the same order.

Needs Triton >= 3.6 with Gluon and an SM90 GPU; imported lazily (CPU tests compile it for sm_90
with Triton's bundled ptxas and check the loop's SASS: see tests/test_gemm_gluon.py).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from jetrl.fp8.kernels.gluon_tiles import GluonConfig

GROUP = 128  # K per scale group (host side)
_G = gl.constexpr(GROUP)  # the same inside kernels


def gluon_config(m: int, n: int, k: int) -> GluonConfig:
    """The tiles for an (m, n, k) GEMM: the dispatcher's rule (gemm.py), a pure function of the shape."""
    from jetrl.fp8.gemm import gluon_tiles

    return gluon_tiles(m, n, k)


def supports(m: int, n: int, k: int) -> bool:
    """Shapes this kernel computes: K a multiple of 256, 16-byte-aligned rows (TMA)."""
    return m >= 1 and n >= 1 and k % (2 * GROUP) == 0


@gluon.jit
def _producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, off_m, off_n, num_k, STAGES: gl.constexpr):
    for g in range(num_k):
        s = g % STAGES
        # a slot's first use passes at once: a fresh barrier counts as having completed phase "1"
        mbarrier.wait(empty.index(s), ((g // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [off_m, g * _G], ready.index(s), a_bufs.index(s))
        tma.async_copy_global_to_shared(b_desc, [off_n, g * _G], ready.index(s), b_bufs.index(s))


@gluon.jit
def _issue(a_bufs, b_bufs, ready, g, tile, WG: gl.constexpr, STAGES: gl.constexpr):
    """Start group g's FP8 wgmma for this warpgroup's 64 rows (async), overwriting ``tile`` (a retired
    tile whose registers it reuses: use_acc=False ignores its values)."""
    s = g % STAGES
    mbarrier.wait(ready.index(s), (g // STAGES) & 1)
    a = a_bufs.index(s).slice(WG * 64, 64, dim=0)
    return warpgroup_mma(a, b_bufs.index(s).permute((1, 0)), tile, use_acc=False, is_async=True)


@gluon.jit
def _retire(p, acc, empty, g, sa_rows, row_ok, sb_tile, stride_sak, OUTSTANDING: gl.constexpr,
            STAGES: gl.constexpr):
    """Wait for group g's tile (leaving OUTSTANDING later groups in flight), free its slot, rescale it into acc."""
    sa = gl.load(sa_rows + g * stride_sak, mask=row_ok, other=0.0)
    sb = gl.load(sb_tile + g)
    p = warpgroup_mma_wait(num_outstanding=OUTSTANDING, deps=(p,))
    mbarrier.arrive(empty.index(g % STAGES), count=1)
    return acc + p * (sa * sb)[:, None], p


@gluon.jit
def _consumer(a_bufs, b_bufs, ready, empty, sa_ptr, sb_ptr, out_ptr, off_m, off_n, M, N, num_k,
              stride_sam, stride_sak, stride_sbn, stride_om,
              WG: gl.constexpr, UNROLL: gl.constexpr, STAGES: gl.constexpr, BLOCK_N: gl.constexpr):
    """One warpgroup: rows [off_m + 64 WG, + 64) of the tile, groups in runs of UNROLL (2 or 4).

    Within a run two tiles alternate: group j+1's wgmma runs while group j is rescaled, so only the
    run's last rescale leaves the tensor cores to the other warpgroup; no wgmma is in flight across
    the loop's back edge (ptxas would serialize them all).
    """
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, BLOCK_N, 32])
    rows = off_m + WG * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
    row_ok = rows < M
    sa_rows = sa_ptr + rows * stride_sam
    sb_tile = sb_ptr + (off_n // _G) * stride_sbn
    acc = gl.zeros([64, BLOCK_N], gl.float32, layout)
    ta = gl.zeros([64, BLOCK_N], gl.float32, layout)
    tb = gl.zeros([64, BLOCK_N], gl.float32, layout)
    for g in range(0, num_k, UNROLL):
        pa = _issue(a_bufs, b_bufs, ready, g, ta, WG, STAGES)
        pb = _issue(a_bufs, b_bufs, ready, g + 1, tb, WG, STAGES)
        if UNROLL == 4:
            acc, ta = _retire(pa, acc, empty, g, sa_rows, row_ok, sb_tile, stride_sak, 1, STAGES)
            pa = _issue(a_bufs, b_bufs, ready, g + 2, ta, WG, STAGES)
            acc, tb = _retire(pb, acc, empty, g + 1, sa_rows, row_ok, sb_tile, stride_sak, 1, STAGES)
            pb = _issue(a_bufs, b_bufs, ready, g + 3, tb, WG, STAGES)
            acc, ta = _retire(pa, acc, empty, g + 2, sa_rows, row_ok, sb_tile, stride_sak, 1, STAGES)
            acc, tb = _retire(pb, acc, empty, g + 3, sa_rows, row_ok, sb_tile, stride_sak, 0, STAGES)
        else:
            acc, ta = _retire(pa, acc, empty, g, sa_rows, row_ok, sb_tile, stride_sak, 1, STAGES)
            acc, tb = _retire(pb, acc, empty, g + 1, sa_rows, row_ok, sb_tile, stride_sak, 0, STAGES)
    cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    out = out_ptr + rows[:, None] * stride_om + cols[None, :]
    gl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols < N)[None, :])


@gluon.jit
def _gemm_kernel(a_desc, b_desc, sa_ptr, sb_ptr, out_ptr, M, N, K, stride_sam, stride_sak, stride_sbn, stride_om,
                 STAGES: gl.constexpr, UNROLL: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    WARPGROUPS: gl.constexpr = BLOCK_M // 64
    # program_id(0) walks M first: the CTAs that share a weight tile run side by side (one HBM read)
    off_m = gl.program_id(0) * BLOCK_M
    off_n = gl.program_id(1) * BLOCK_N
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
            (_consumer, (a_bufs, b_bufs, ready, empty, sa_ptr, sb_ptr, out_ptr, off_m, off_n, M, N, num_k,
                         stride_sam, stride_sak, stride_sbn, stride_om, 0, UNROLL, STAGES, BLOCK_N)),
            (_consumer, (a_bufs, b_bufs, ready, empty, sa_ptr, sb_ptr, out_ptr, off_m, off_n, M, N, num_k,
                         stride_sam, stride_sak, stride_sbn, stride_om, 1, UNROLL, STAGES, BLOCK_N)),
            (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, off_m, off_n, num_k, STAGES)),
        ], [4, 1], [224, 24])
    else:
        gl.warp_specialize([
            (_consumer, (a_bufs, b_bufs, ready, empty, sa_ptr, sb_ptr, out_ptr, off_m, off_n, M, N, num_k,
                         stride_sam, stride_sak, stride_sbn, stride_om, 0, UNROLL, STAGES, BLOCK_N)),
            (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, off_m, off_n, num_k, STAGES)),
        ], [1], [24])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))


def descriptors(a_codes: torch.Tensor, b_codes: torch.Tensor, cfg: GluonConfig) -> tuple:
    """TMA descriptors of the (M, K) activation and (N, K) weight codes, one group of K per box."""
    def desc(t, rows):
        layout = gl.NVMMASharedLayout.get_default_for([rows, GROUP], gl.float8e4nv)
        return TensorDescriptor(t, list(t.shape), list(t.stride()), [rows, GROUP], layout)

    return desc(a_codes, cfg.block_m), desc(b_codes, cfg.block_n)


def gemm_mid_m(a_codes: torch.Tensor, a_scales: torch.Tensor, b_codes: torch.Tensor, b_scales: torch.Tensor,
               out_dtype: torch.dtype = torch.bfloat16, config: GluonConfig | None = None) -> torch.Tensor:
    """out[M, N] = deq(a) @ deq(b)^T for a (M, K) 1x128 and b (N, K) 128x128 (row-major codes), K % 256 == 0."""
    m, k = a_codes.shape
    n = b_codes.shape[0]
    if not supports(m, n, k):
        raise ValueError(f"gemm_mid_m: K must be a multiple of {2 * GROUP}, got an ({m}, {k}) x ({n}, {k}) GEMM")
    assert b_codes.shape[1] == k and a_codes.stride(1) == 1 and b_codes.stride(1) == 1, (a_codes.shape, b_codes.shape)
    assert a_scales.shape == (m, k // GROUP) and b_scales.shape == (-(-n // GROUP), k // GROUP)
    assert b_scales.stride(1) == 1
    cfg = config or gluon_config(m, n, k)
    assert GROUP % cfg.block_n == 0 and cfg.block_m in (64, 128), cfg
    a_desc, b_desc = descriptors(a_codes, b_codes, cfg)
    out = torch.empty((m, n), dtype=out_dtype, device=a_codes.device)
    grid = (-(-m // cfg.block_m), -(-n // cfg.block_n))
    unroll = cfg.unroll if k % (cfg.unroll * GROUP) == 0 else 2
    _gemm_kernel[grid](a_desc, b_desc, a_scales, b_scales, out, m, n, k, a_scales.stride(0), a_scales.stride(1),
                       b_scales.stride(0), out.stride(0), STAGES=cfg.stages, UNROLL=unroll, num_warps=4)
    return out
