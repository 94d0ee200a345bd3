"""Block-scaled FP8 GEMM: one signature, several backends, the emulation is the spec.

Every FP8 GEMM in jetrl is an "NT" product of two K-major operands,

    out[M, N] = deq(a)[M, K] @ deq(b)[N, K]^T,

where ``a`` is quantized in 1x128 groups along K and ``b`` in 128x128 blocks (a weight) or
in 1x128 groups along K (the wgrad operand). The three GEMMs of a linear layer y = x W^T map
onto it as (design.md §4):

    fprop  Y[M,N]  = X[M,K]   . W[N,K]^T     a = q(X, 1x128)      b = q(W, 128x128)
    dgrad  dX[M,K] = dY[M,N]  . W^T[K,N]^T   a = q(dY, 1x128)     b = q(W, 128x128).t()
    wgrad  dW[N,K] = dY^T[N,M] . X^T[K,M]^T  a = q(dY^T, 1x128)   b = q(X^T, 1x128)

Backends, chosen per device and, on an SM90 GPU, per shape (:func:`choose_backend`), and
overridable (``override_backend``, or the ``JETRL_GEMM_BACKEND`` environment variable):

* ``emulated``: dequantize both operands exactly and matmul with fp64 accumulation. Runs
  everywhere; it *is* the specification the fast paths are tested against, and it is
  batch-invariant (see :func:`gemm_emulated`).
* ``scaled_mm``: ``torch.nn.functional.scaled_mm`` with BlockWise1x128 / BlockWise128x128
  scaling (cuBLAS, SM90+). Layouts measured on the H200 (design.md §3): ``a`` row-major,
  ``b`` passed as a column-major (K, N) view of the K-major codes; 1x128 scales (rows, K/128)
  column-major; 128x128 scales as a (K/128, N/128) view with strides (1, K/128), the K-block
  count padded to a multiple of 4. Dims that are not multiples of 128 (K, N) or 16 (M) are
  zero-padded: zero codes add nothing.
  It accumulates in the tensor cores' reduced-precision fp32, so it agrees with the
  emulation to about 2e-3 relative, not bitwise.
* ``triton``: the small-M split-K kernel (kernels/gemm_triton.py) for decode-sized GEMMs
  against a 128x128-block weight, where cuBLAS's fixed per-call cost dominates.
* ``gluon``: the warp-specialized Hopper kernel (kernels/gemm_gluon.py: TMA producer warp, two
  FP8 ``wgmma`` groups in flight per consumer warpgroup), K a multiple of 256: small weights at M <= 16,
  most layers from 17 to 64 rows, and above 64 rows where its output tiles fit in one wave of the GPU's
  SMs, where cuBLAS's 128 x 128 tiles leave SMs idle (:func:`choose_backend` has the rule).

Exact mode (jetrl/exact.py) overrides all of them for forward GEMMs on CUDA, so a row's sum runs in the same order
in a decode step and in the trainer's forward (:func:`_gemm_exact`): the Gluon kernel where the *layer* allows it (an
SM90 GPU, K a multiple of 256) -- its bits do not depend on its tiles, measured at every M
and tile (bench/probe_gluon_invariance.py, run DH), so it runs the fastest tile per shape -- else one Triton kernel
with one tile shape and one K split per layer for every M, and one binary (kernels/gemm_exact_triton.py). Which of
the two is a property of the layer, never of M. Gradient GEMMs (``batch_invariant=False``) keep the per-shape choice.

Per-shape dispatch on SM90 (:func:`choose_backend`) is a fixed rule of the shape -- never a
timing taken at run time -- so a given shape always runs the same kernel with the same
summation order and results are reproducible (the one exception: codes TMA cannot read, a
misaligned view, leave the Gluon kernel for the next choice). The thresholds come from ``jetrl
bench`` section (c) and bench/sweep_gemm_gluon.py on an H200 (docs/benchmarks.md). BF16 is not a candidate: a BF16 GEMM would
not compute the quantized graph, and the rollout would leave the trainer's precision flow.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F

from jetrl.exact import exact_active
from jetrl.fp8.kernels.gluon_tiles import K_MULTIPLE
from jetrl.fp8.quant import BLOCK, Float8Blocks
from jetrl.overrides import ScopedOverride, env_choice

BACKENDS = ("emulated", "scaled_mm", "triton", "gluon")
SMALL_M_MAX = 64  # rows up to which the Triton small-M kernel beats cuBLAS block FP8 (bench section c)
ONE_WAVE_CTAS = 132  # the H200's SM count: the Gluon kernel is chosen where its tiles fill one wave
GLUON_MIN_M = 16  # up to this many rows the Triton kernel's 16-row tiles win (bench (c); run FE) ...
SMALL_WEIGHT = 6 * 2**20  # ... except on a weight of at most this many elements (choose_backend)
TRITON_MAX_M = 32  # up to this many rows a long K keeps Triton's split-K (choose_backend; run FE)
NARROW_BLOCK_N = 32  # the Gluon kernel's tile width for narrow layers at M <= 64 (gluon_tiles)
LONG_K = 8192  # K from which split-K (Triton, M <= 64) or 128 x 64 tiles (Gluon) win (bench/sweep_gemm_gluon.py)
_override = ScopedOverride("FP8 GEMM backend", BACKENDS)
_resolved: dict[str, str] = {}


def fp8_gemm(a: Float8Blocks, b: Float8Blocks, out_dtype: torch.dtype = torch.bfloat16,
             batch_invariant: bool = True) -> torch.Tensor:
    """out[M, N] = deq(a) @ deq(b)^T for K-major block-FP8 operands (see module docstring).

    ``batch_invariant``: a row's result must not depend on M. Forward GEMMs need it (their outputs are
    quantized again downstream, in the rollout and in the trainer alike); gradient GEMMs do not. The
    emulation then accumulates in fp64 (else fp32); in exact mode on CUDA it selects the fixed-tile kernel.
    """
    _check_operands(a, b)
    if batch_invariant and exact_active(a.codes.device):
        return _gemm_exact(a, b, out_dtype)
    backend = resolve_backend(a.codes.device)
    m, n, k = a.shape[0], b.shape[0], a.shape[1]
    if backend == "auto":
        backend = choose_backend(m, b.block, n, k)
    if backend == "gluon" and not _gluon_takes(a, b):
        backend = "triton" if m <= SMALL_M_MAX else "scaled_mm"  # e.g. a misaligned view: no TMA descriptor
    if backend == "gluon":
        from jetrl.fp8.kernels.gemm_gluon import gemm_mid_m

        return gemm_mid_m(a.codes, a.scales, b.codes, b.scales, out_dtype, gluon_tiles(m, n, k))
    if backend == "triton" and b.block == (BLOCK, BLOCK):
        from jetrl.fp8.kernels.gemm_triton import gemm_small_m

        return gemm_small_m(a.codes, a.scales, b.codes, b.scales, out_dtype)
    if backend in ("scaled_mm", "triton", "gluon"):  # the fast kernels take 128x128-block weights only
        return _scaled_mm(a, b, out_dtype)
    return gemm_emulated(a, b, out_dtype, torch.float64 if batch_invariant else torch.float32)


EXACT_GLUON_LARGE = (128, 128, 4, 2)  # exact mode's Gluon tile above 256 rows (run DH: the fastest at 9216 rows)


def _gemm_exact(a: Float8Blocks, b: Float8Blocks, out_dtype: torch.dtype) -> torch.Tensor:
    """Exact mode's forward GEMM: a batch-invariant kernel at every M, chosen by the layer alone (module docstring).

    The Gluon kernel adds a row's 128-groups in order into one fp32 accumulator (``acc + P_g * (sa sb)``, P_g a fresh
    wgmma), whatever its tile: on the H200 every one of 8 tile configurations, with and without PDL, gave every row
    of 1-9216-row calls the bits of one reference call, for an 8B layer's four shapes (run DH). So it runs the fast
    path's tiles up to 256 rows and 128 x 128 above: an 8B layer's four GEMMs 69 µs at 64 rows (the Triton exact
    kernel 110), 4.4 ms at 9216 rows (7.7; cuBLAS 3.6)."""
    from jetrl.fp8.kernels import capability, has_triton

    if b.block != (BLOCK, BLOCK):  # never a silent fallback to a per-shape kernel
        raise ValueError(f"exact mode's FP8 GEMM takes {BLOCK}x{BLOCK} weight blocks (a forward GEMM), got {b.block}; "
                         "quantize the weight in 128x128 blocks, pass batch_invariant=False for a gradient GEMM, or "
                         "leave exact mode (jetrl.exact.use_exact(False))")
    if not has_triton() or capability(a.codes.device) < (8, 9):
        raise RuntimeError("exact mode's FP8 GEMM needs Triton and an SM89+ GPU (FP8 tensor cores); leave exact "
                           "mode (jetrl.exact.use_exact(False)) on this machine")
    if _exact_takes_gluon(b):
        from jetrl.fp8.kernels.gemm_gluon import gemm_mid_m
        from jetrl.fp8.kernels.gluon_tiles import GluonConfig, tma_problem

        m, n, k = a.shape[0], b.shape[0], a.shape[1]
        # codes TMA cannot read (a misaligned or strided view) are copied: the kernel never changes with the layout
        a_codes, b_codes = (t if tma_problem(name, t) is None else t.clone(memory_format=torch.contiguous_format)
                            for name, t in (("a", a.codes), ("b", b.codes)))
        tiles = gluon_tiles(m, n, k) if m <= 256 else GluonConfig(*EXACT_GLUON_LARGE)
        return gemm_mid_m(a_codes, a.scales, b_codes, b.scales, out_dtype, tiles)
    from jetrl.fp8.kernels.gemm_exact_triton import gemm_exact

    return gemm_exact(a.codes, a.scales, b.codes, b.scales, out_dtype)


def _exact_takes_gluon(b: Float8Blocks) -> bool:
    """Exact mode's kernel choice, a property of the layer's shape and the GPU, never of M nor of how the codes lie
    in memory: the Gluon kernel on an SM90 GPU with Gluon, for K a multiple of 256."""
    return _is_sm90(b.codes.device) and has_gluon() and b.shape[1] % K_MULTIPLE == 0


def choose_backend(m: int, b_block: tuple[int, int] = (BLOCK, BLOCK), n: int | None = None,
                   k: int | None = None) -> str:
    """The SM90 kernel for an (m, n, k) GEMM: a fixed rule of the shape (see module docstring).

    From ``jetrl bench`` (c) and ``bench/sweep_gemm_gluon.py`` on an H200 (docs/benchmarks.md):

    * M <= 16: the Triton small-M kernel (16-row tiles; Gluon's 64-row wgmma tile is 10-60% slower at
      M = 1 and 16 on the 8B's layers), except a small weight (at most ``SMALL_WEIGHT`` elements: the
      layers of Qwen3-0.6B, o of 1.7B), which takes the Gluon kernel: there the call is its fixed cost,
      and Gluon's is lower (0.6B at M = 1: 3.7-4.8 µs against Triton's 5.0-6.6; runs FB, FD,
      bench/probe_small_gemms.py);
    * M <= 32: the Gluon kernel unless K is long (8B at M = 32: qkv 11.1 against Triton's 13.8 µs, o 10.2
      against 11.1, gate_up even; down, K = 12288, and 4B's down, K = 9728, keep Triton; run FE);
    * M <= 64: the Gluon kernel (persistent; 64 x 32 tiles for a narrow layer, o and down, so that it
      runs 128 CTAs instead of 64; 64 x 64 otherwise), except a wide layer with a long K, which keeps
      Triton's split-K;
    * M > 64: the Gluon kernel where its tiles fit in one wave of 132 SMs (qkv and o at M = 128, o and
      down at M = 256), else cuBLAS (gate_up, and qkv at M = 256: cuBLAS reaches 1.1 PFLOPS on gate_up,
      the Gluon kernel 0.92).

    Without n and k (or without Gluon) only M decides: Triton up to 64 rows, cuBLAS above.
    """
    if b_block != (BLOCK, BLOCK):
        return "scaled_mm"  # wgrad's 1x128 operands: cuBLAS only
    if n is not None and k is not None and k % K_MULTIPLE == 0 and has_gluon():
        if m <= GLUON_MIN_M:
            return "gluon" if n * k <= SMALL_WEIGHT else "triton"
        if m <= TRITON_MAX_M:
            return "gluon" if k < LONG_K else "triton"
        if m <= SMALL_M_MAX:
            return "gluon" if k < LONG_K or gluon_tiles(m, n, k).block_n == NARROW_BLOCK_N else "triton"
        tiles = gluon_tiles(m, n, k)
        if -(-m // tiles.block_m) * -(-n // tiles.block_n) <= ONE_WAVE_CTAS:
            return "gluon"
    return "triton" if m <= SMALL_M_MAX else "scaled_mm"


def gluon_tiles(m: int, n: int, k: int):
    """The Gluon kernel's tiles for an (m, n, k) GEMM, a pure function of the shape (the sweep's best):
    up to 64 rows 64 x 32 where 64-wide tiles would fill at most half the SMs (bench (c) at M = 64: o
    9.8 -> 9.2 µs, down 24.1 on Triton -> 20.6), else 64 x 64 (32-wide tiles lose on qkv and gate_up); above,
    128 x 64 with 8 stages for a long K, 64 x 128 otherwise."""
    from jetrl.fp8.kernels.gluon_tiles import GluonConfig

    if m <= SMALL_M_MAX:
        if -(-n // 64) <= ONE_WAVE_CTAS // 2:
            return GluonConfig(64, NARROW_BLOCK_N, stages=8, unroll=4)
        return GluonConfig(64, 64, stages=6, unroll=4)
    if k >= LONG_K:
        return GluonConfig(128, 64, stages=8, unroll=4)
    return GluonConfig(64, 128, stages=6, unroll=2)


GLUON_MIN_TRITON = (3, 6)  # the Gluon API the kernel is written against (warp_specialize's signature changed)


@functools.cache
def has_gluon() -> bool:
    """True if the Gluon kernel can be built here: Triton >= 3.6 with Gluon's Hopper API. With an older
    Triton (its experimental Gluon API differs) the Triton and cuBLAS kernels take every shape."""
    try:
        import triton

        if tuple(int(p) for p in triton.__version__.split(".")[:2]) < GLUON_MIN_TRITON:
            return False
        import jetrl.fp8.kernels.gemm_gluon  # noqa: F401
    except Exception:  # noqa: BLE001 -- no Triton, or one without Gluon: the other backends take over
        return False
    return True


def gemm_emulated(a: Float8Blocks, b: Float8Blocks, out_dtype: torch.dtype = torch.bfloat16,
                  accumulate: torch.dtype = torch.float64) -> torch.Tensor:
    """The spec: dequantize (exact) and multiply, accumulating in ``accumulate``, rounded once to ``out_dtype``.

    Each dequantized value has at most 4 + 24 significant bits, so every product is exact in
    fp64 and the fp64 sum over K carries an error far below one fp32 ulp: the rounded result
    is (but for near-ties) the correctly rounded exact dot product, whatever order the BLAS
    sums in. That makes the CPU forward batch-invariant: a row's output does not depend on how
    many other rows share the GEMM, so FP8 codes downstream do not flip between the engine's
    decode (M = batch) and the trainer's forward (M = all tokens). Measured on SmolLM2 (CPU,
    ``jet``): engine-vs-trainer logprob gaps fall from 0.1 nats mean (fp32) to 0 (fp64).
    """
    return (a.dequantize(accumulate) @ b.dequantize(accumulate).t()).to(out_dtype)


def resolve_backend(device: torch.device | str) -> str:
    """The backend for ``device``: the override if set, else chosen once per device.

    ``"auto"`` (the default on SM90 with Triton) means :func:`choose_backend` picks per shape.
    A backend named in ``JETRL_GEMM_BACKEND`` that the device cannot run raises a ValueError.
    """
    if _override.value is not None:
        return _override.value
    device = torch.device(device)
    key = f"{device.type}:{device.index}"
    if key not in _resolved:
        env = env_choice("JETRL_GEMM_BACKEND", ("auto", *BACKENDS), "auto = per-shape choice on SM90")
        if env == "auto" and not has_block_scaled_mm(device):
            env = None  # auto off SM90: the emulation
        if env not in (None, "emulated") and not has_block_scaled_mm(device):
            raise ValueError(
                f"JETRL_GEMM_BACKEND={env} needs an SM90+ GPU with block-scaled F.scaled_mm (the Triton "
                f"kernel hands wgrad's 1x128 operands to it); {device} has none: unset it or use emulated"
            )
        if env in (None, "auto", "triton") and has_block_scaled_mm(device):
            from jetrl.fp8.kernels import has_triton

            if env == "triton" and not has_triton():
                raise ValueError("JETRL_GEMM_BACKEND=triton but Triton is not installed; pip install triton")
            env = env if env == "triton" else ("auto" if has_triton() else "scaled_mm")
        if env == "gluon" and not has_gluon():
            raise ValueError("JETRL_GEMM_BACKEND=gluon needs Triton >= 3.6 with Gluon (pip install 'triton>=3.6')")
        _resolved[key] = env or "emulated"
    return _resolved[key]


def has_block_scaled_mm(device: torch.device) -> bool:
    """True on CUDA SM90+ with a torch that exposes block-scaled ``F.scaled_mm``."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if not hasattr(F, "scaled_mm") or not hasattr(F, "ScalingType"):
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def override_backend(name: str) -> contextlib.AbstractContextManager[None]:
    """Force a backend inside the block (tests, benchmarks)."""
    return _override(name)


def _check_operands(a: Float8Blocks, b: Float8Blocks) -> None:
    if a.codes.dim() != 2 or b.codes.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(
            f"fp8_gemm computes a[M,K] @ b[N,K]^T: contraction dims differ, a {tuple(a.shape)} vs "
            f"b {tuple(b.shape)}; pass both operands K-major (quantize x.t() for a K-by-M tensor)"
        )
    if a.block != (1, BLOCK):
        raise ValueError(f"fp8_gemm: operand a must be quantized in (1, {BLOCK}) groups, got {a.block}")
    if b.block not in ((1, BLOCK), (BLOCK, BLOCK)):
        raise ValueError(
            f"fp8_gemm: operand b must be quantized in (1, {BLOCK}) or ({BLOCK}, {BLOCK}) blocks, got {b.block}"
        )
    if a.codes.device != b.codes.device:
        raise ValueError(f"fp8_gemm: operands on different devices ({a.codes.device} vs {b.codes.device})")


def _gluon_takes(a: Float8Blocks, b: Float8Blocks) -> bool:
    """The Gluon kernel's contract: a Hopper GPU (``wgmma`` is SM90 only: a later GPU takes the other
    kernels), a 128x128-block weight, and codes it can read (gluon_tiles.operand_problem)."""
    from jetrl.fp8.kernels.gluon_tiles import operand_problem

    return _is_sm90(a.codes.device) and b.block == (BLOCK, BLOCK) and operand_problem(a.codes, b.codes) is None


@functools.cache
def _is_sm90(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def _pad(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Zero-pad codes (or pad scales with 1.0) up to multiples of (rows, cols)."""
    pad_r, pad_c = -t.shape[0] % rows, -t.shape[1] % cols
    if not (pad_r or pad_c):
        return t
    if t.dtype == torch.float32:
        return F.pad(t, (0, pad_c, 0, pad_r), value=1.0)
    # F.pad has no float8 kernel: pad the raw bytes (code 0x00 is +0.0).
    return F.pad(t.view(torch.uint8), (0, pad_c, 0, pad_r)).view(t.dtype)


def _col_major(scales: torch.Tensor) -> torch.Tensor:
    """``scales`` (rows, groups) laid out column-major, as cuBLAS reads a 1x128 operand's scales: no copy when they
    already are (the quantizer writes them so on CUDA, linear.py), so no launch and no host work but a stride test."""
    if scales.stride(0) == 1 and (scales.shape[1] == 1 or scales.stride(1) == scales.shape[0]):
        return scales
    return scales.t().contiguous().t()


def _weight_operand(b: Float8Blocks) -> tuple[torch.Tensor, torch.Tensor]:
    """A 128x128-block operand's (codes, scales) as ``F.scaled_mm`` takes them: the codes as a column-major (K, N)
    view, the scales as a (Kb4, N/128) view with strides (1, Kb4) -- cuBLAS wants the K-block count padded to a
    multiple of 4 (16-byte rows); measured on the H200, K=576 asks for 8 x N/128 scales. A cached weight reads
    them every call, so they are built once per :class:`Float8Blocks` (views of its buffers, which a refresh
    rewrites in place; a padded copy is never kept, it would go stale)."""
    views = b.__dict__.get("_operand")
    if views is not None:
        return views
    b_codes = _pad(b.codes, BLOCK, BLOCK)  # (Np, Kp) K-major
    scale_b = _pad(b.scales, 1, 4)
    views = (b_codes.t(), scale_b.t())
    if b_codes is b.codes and scale_b is b.scales:
        object.__setattr__(b, "_operand", views)
    return views


def _scaled_mm(a: Float8Blocks, b: Float8Blocks, out_dtype: torch.dtype) -> torch.Tensor:
    """``F.scaled_mm`` on jetrl's operands (module docstring). Each aten op costs the host ~5-10 µs on the H200
    machines, and an eager layer is host-bound at small shapes (bench/probe_host_parts.py), so operands already in
    cuBLAS's layout pass through untouched."""
    m, n = a.shape[0], b.shape[0]
    a_codes = _pad(a.codes, 16, BLOCK)  # (Mp, Kp) row-major
    scale_a = _col_major(_pad(a.scales, 16, 1))  # (Mp, Kp/128) column-major
    if b.block == (BLOCK, BLOCK):
        b_codes_t, scale_b = _weight_operand(b)
        recipe_b = F.ScalingType.BlockWise128x128
    else:
        b_codes_t = _pad(b.codes, 16, BLOCK).t()  # (Kp, Np) column-major
        scale_b = _col_major(_pad(b.scales, 16, 1))  # (Np, Kp/128) column-major
        recipe_b = F.ScalingType.BlockWise1x128
    out = F.scaled_mm(
        a_codes,
        b_codes_t,
        scale_a,
        F.ScalingType.BlockWise1x128,
        scale_b,
        recipe_b,
        output_dtype=out_dtype,
    )
    return out if out.shape[0] == m and out.shape[1] == n else out[:m, :n]
