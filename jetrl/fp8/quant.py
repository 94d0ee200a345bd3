"""The one quantizer: every FP8 code and scale in jetrl comes out of :func:`quantize`.

Why one function: Jet-RL is on-policy only if the rollout samples from exactly the
quantized graph the trainer differentiates. Codebases that quantize "the same way" with
two implementations disagree in the last bit (divide vs multiply-by-reciprocal, eps
guards, rounding: verl's weight cast multiplies by 1/s, vLLM's activation quantizer divides by s,
torchao scales by 448/amax, DeepGEMM's reference and NeMo-RL guard amax differently). So the
trainer's forward, the rollout engine and the FP8 export all call this function, and a test
checks their codes and scales with ``torch.equal`` on uint8 views.

Format: E4M3 (``torch.float8_e4m3fn``, max 448, no inf, NaN = S.1111.111), FP32 scales.

Granularity is a block shape ``(br, bc)`` over a 2-D tensor ``x`` of shape (R, C):

* ``(1, 128)``   1x128 groups along the contraction dim: activations, output gradients;
* ``(128, 128)`` blocks: weights;
* tokens groups for wgrad are ``(1, 128)`` groups of the *transposed* operand, i.e.
  ``quantize(x.t(), (1, 128))``: the GEMM contracts over tokens, so the groups run along M.

A dim that is not a multiple of the block is padded with zeros inside the quantizer; zeros
never raise an amax, so the last, partial group is quantized as if it stood alone. The
returned codes have the input's shape; scales have shape (ceil(R/br), ceil(C/bc)).

The exact formula (it decides the codes, so it is the spec every kernel must match bit
for bit). Per block B, in float32 (bf16/fp16 inputs are upcast exactly first):

    amax  = max_{i in B} |x_i|                      (NaN if any x_i is NaN)
    s     = max(amax / 448, 2^-126)                 IEEE fp32 division, then the floor
    s     = 2^ceil(log2 s)        if pow2_scale     (exact, by exponent bits; UE8M0-style)
    r     = 1 / s                                   IEEE fp32 reciprocal, once per block
    q_i   = e4m3_rne(clamp(x_i * r, -448, 448))     multiply by the reciprocal, RNE cast
    x_i  ~= q_i * s                                 dequantization; ``s`` is what the GEMM
                                                    and the HF ``weight_scale_inv`` hold

The floor 2^-126 (the smallest normal fp32) guards amax == 0 and keeps ``r`` finite for
subnormal-tiny inputs; an all-zero block gets codes 0. The explicit clamp makes the
saturation independent of the backend's cast (x * r can exceed 448 by one fp32 ulp).

Round-trip bound, per element: with v = x * r, |v| <= 448 (plus one ulp), E4M3 keeps 3
mantissa bits for |v| >= 2^-6 and a fixed step of 2^-9 below, so

    |x - q * s| <= 2^-4 * |x| + 2^-10 * s   (+ fp32 rounding of x * r, about 2^-24 |x|).

NaN/Inf policy: a block that holds a NaN or an Inf gets scale NaN and every code in it
the canonical NaN 0x7F, so the non-finite value *propagates* through dequantization and every GEMM that
reads it, never saturating silently into +-448. Callers that must stop at once pass
``check_finite=True`` (the weight cache always does) and get a :class:`NonFiniteError`
naming the tensor; the trainer acts on a non-finite loss or gradient for activations.

Autograd: codes and scales are not differentiable, so :func:`quantize` reads ``x.detach()`` (the fused
two-layout path of :func:`quantize_with_transpose` is a Triton kernel, outside autograd, and its fallback
calls :func:`quantize`). Without it the reference path's codes (CPU) carried x's ``grad_fn``, and the last
activation quantized, which linear.py memoizes for sibling layers, kept its whole forward graph alive --
with each Float8Linear's weight cache in its autograd context -- after the model had been converted back
(the bench's (g) runs recipes one after another on one model).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from jetrl.overrides import env_choice

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
SCALE_FLOOR = 2.0**-126
BLOCK = 128
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class NonFiniteError(ValueError):
    """A tensor that must be finite (weights, or activations under ``check_finite``) is not."""


@dataclass(frozen=True)
class Float8Blocks:
    """Block-scaled E4M3 tensor: ``codes`` (R, C) float8_e4m3fn and ``scales`` (R/br, C/bc) fp32.

    ``x ~= codes * scales`` broadcast over ``block``. Not a tensor subclass on purpose: the
    GEMM dispatch and the autograd Function take the two tensors explicitly.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    block: tuple[int, int]

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """codes * scale per block, computed in fp32 (exact: 4-bit mantissa times fp32 scale).

        A cached weight (see :meth:`memoize`) keeps its dequantization, so the emulated GEMM
        does not rebuild it on every decode step; the weight cache clears it on each new version.
        """
        memo = getattr(self, "_memo", None)
        if memo is not None:
            if dtype not in memo:
                memo[dtype] = self._dequantize(dtype)
            return memo[dtype]
        return self._dequantize(dtype)

    def memoize(self) -> Float8Blocks:
        """Keep the dequantization after its first use (for weights read many times per version)."""
        object.__setattr__(self, "_memo", {})
        return self

    def forget(self) -> None:
        """Drop a memoized dequantization (the codes changed in place)."""
        if getattr(self, "_memo", None):
            self._memo.clear()

    def _dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        rows, cols = self.codes.shape
        br, bc = self.block
        scale = self.scales.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
        return (self.codes.float() * scale).to(dtype)

    def t(self) -> Float8Blocks:
        """The transposed tensor from the *same* codes (no re-quantization from high precision).

        Exact for square blocks: block (i, j) of W is block (j, i) of W^T with the same scale.
        This is how dgrad gets W^T from the weight cache.
        """
        # strides recomputed: .contiguous() would keep a (k, 1) result's stride (1, k), which the GEMM kernels reject
        # (a weight one block tall, e.g. a 128-row down_proj's W^T)
        scales = self.scales.t().clone(memory_format=torch.contiguous_format)
        return Float8Blocks(transpose_codes(self.codes), scales, self.block[::-1])


def amax_to_scale(amax: torch.Tensor, pow2_scale: bool = False) -> torch.Tensor:
    """fp32 dequant scale from a per-block amax (see the module docstring); NaN if amax is not finite."""
    # tensor / tensor: CUDA eager turns division by a Python scalar into a multiplication by
    # its reciprocal, which changes scale bits; this form is an IEEE division on every device.
    scale = torch.clamp_min(amax / torch.full_like(amax, E4M3_MAX), SCALE_FLOOR)
    if pow2_scale:
        # Round up to a power of two by exponent bits: exact, unlike exp2(ceil(log2(s))).
        # s >= 2^-126 is normal, so bits = sign 0 | exponent | mantissa.
        bits = scale.view(torch.int32)
        exponent = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
        scale = (exponent << 23).view(torch.float32)
    return torch.where(torch.isfinite(amax), scale, torch.full_like(scale, float("nan")))


def quantize(
    x: torch.Tensor,
    block: tuple[int, int] = (1, BLOCK),
    *,
    pow2_scale: bool = False,
    check_finite: bool = False,
    name: str = "tensor",
    col_major_scales: bool = False,
    out: Float8Blocks | None = None,
) -> Float8Blocks:
    """Quantize a 2-D tensor to block-scaled E4M3 with the formula in the module docstring.

    ``name`` is used in error messages only (e.g. ``"model.layers.0.mlp.up_proj.weight"``).
    ``col_major_scales`` returns the same scales laid out column-major, as cuBLAS's block-scaled GEMM
    reads its A operand's (so no transposing copy is needed before it).
    ``out``: write the codes and scales into this tensor's buffers (same block, shapes and device; its
    scales keep their own layout) and return ``out`` itself -- the weight cache refreshes in place so.
    """
    _validate(x, block, name)
    if x.requires_grad:  # codes are not differentiable: no autograd graph may hang off them (module docstring)
        x = x.detach()
    impl = _implementation(x.device, tuple(block))
    if out is None:
        codes, scales = impl(x, block[0], block[1], pow2_scale, col_major_scales=col_major_scales)
        return _finish(Float8Blocks(codes, scales, tuple(block)), check_finite, name)
    _check_out(out, x, tuple(block), name)
    impl(x, block[0], block[1], pow2_scale, out=(out.codes, out.scales))
    return _finish(out, check_finite, name)


def _check_out(out: Float8Blocks, x: torch.Tensor, block: tuple[int, int], name: str) -> None:
    expected = (-(-x.shape[0] // block[0]), -(-x.shape[1] // block[1]))
    if (tuple(out.block) != block or out.codes.shape != x.shape or out.codes.dtype != E4M3
            or not out.codes.is_contiguous() or tuple(out.scales.shape) != expected or out.scales.dtype != torch.float32
            or out.codes.device != x.device or out.scales.device != x.device):
        raise ValueError(
            f"{name}: quantize(out=...) needs contiguous E4M3 codes of shape {tuple(x.shape)} and float32 scales of shape "
            f"{expected} on {x.device} in {block} blocks; got codes {out.codes.dtype} {tuple(out.codes.shape)}, "
            f"scales {out.scales.dtype} {tuple(out.scales.shape)}, block {tuple(out.block)}"
        )


def quantize_with_transpose(
    x: torch.Tensor, *, pow2_scale: bool = False, check_finite: bool = False, name: str = "tensor",
    col_major_scales: bool = False,
) -> tuple[Float8Blocks, Float8Blocks]:
    """``(quantize(x, (1, 128)), quantize(x.t(), (1, 128)))`` in one pass over ``x`` (M, K).

    The two layouts a linear layer needs from one tensor: 1x128 groups along K for fprop or
    dgrad, and 1x128 groups along the tokens M for wgrad. The result is *defined* as the two
    separate calls (same codes, same scales, bit for bit); on CUDA one fused kernel reads x
    once and writes both, instead of two passes and a strided read of x^T.
    Recorders see ``name`` and ``name + "_t"``. ``col_major_scales``: both results' scales column-major (see
    :func:`quantize`), as the GEMMs of a training step read them.
    """
    _validate(x, (1, BLOCK), name)
    if quant_backend(x.device) == "triton":
        from jetrl.fp8.kernels.quant_triton import dual_fits, quantize_dual_triton

        if dual_fits(x):
            codes, scales, codes_t, scales_t = quantize_dual_triton(x, pow2_scale, col_major_scales=col_major_scales)
            out = Float8Blocks(codes, scales, (1, BLOCK)), Float8Blocks(codes_t, scales_t, (1, BLOCK))
            return _finish(out[0], check_finite, name), _finish(out[1], check_finite, f"{name}_t")
    return tuple(quantize(t, (1, BLOCK), pow2_scale=pow2_scale, check_finite=check_finite, name=n,
                          col_major_scales=col_major_scales) for t, n in ((x, name), (x.t(), f"{name}_t")))


def quantize_columns_with_transpose(
    parts: Sequence[torch.Tensor], *, pow2_scale: bool = False, name: str = "tensor", col_major_scales: bool = False,
) -> tuple[Float8Blocks, Float8Blocks]:
    """``quantize_with_transpose(torch.cat(parts, dim=1))`` without building the concatenation.

    ``parts``: (M, n_i) tensors, every n_i but the last a multiple of 128, so that no 1x128 group of the whole
    straddles two parts: each part's groups are then the whole's, and its x^T rows a row range of the whole's x^T.
    The gradient of sibling projections stacked along N (projection_group.py): dgrad and wgrad read it as one
    (M, sum n_i) operand. On CUDA each part is quantized by the dual-layout kernel straight into its columns of the
    outputs (one launch per part, as separate siblings cost, and no copy of the gradient); elsewhere the parts are
    concatenated first. Recorders see ``name`` and ``name + "_t"``.
    """
    for p in parts:
        _validate(p, (1, BLOCK), name)
    first = parts[0]
    if any(p.shape[1] % BLOCK for p in parts[:-1]) or any(p.shape[0] != first.shape[0] or p.device != first.device
                                                           for p in parts):
        raise ValueError(f"{name}: parts must share their rows and device, and every part but the last needs a "
                         f"multiple of {BLOCK} columns; got shapes {[tuple(p.shape) for p in parts]} on "
                         f"{sorted({str(p.device) for p in parts})}")
    width = sum(p.shape[1] for p in parts)
    if quant_backend(first.device) == "triton":
        from jetrl.fp8.kernels.quant_triton import dual_fits, quantize_dual_triton, scale_buffer

        if all(dual_fits(p, width) for p in parts):
            m, device = first.shape[0], first.device
            out = (torch.empty((m, width), dtype=E4M3, device=device),
                   scale_buffer(m, -(-width // BLOCK), col_major_scales, device),
                   torch.empty((width, m), dtype=E4M3, device=device),
                   scale_buffer(width, -(-m // BLOCK), col_major_scales, device))
            col = 0
            for p in parts:
                quantize_dual_triton(p, pow2_scale, col_major_scales=col_major_scales, out=out, out_col=col)
                col += p.shape[1]
            both = Float8Blocks(out[0], out[1], (1, BLOCK)), Float8Blocks(out[2], out[3], (1, BLOCK))
            return _finish(both[0], False, name), _finish(both[1], False, f"{name}_t")
    return quantize_with_transpose(torch.cat(list(parts), dim=1), pow2_scale=pow2_scale, name=name,
                                   col_major_scales=col_major_scales)


def _finish(out: Float8Blocks, check_finite: bool, name: str) -> Float8Blocks:
    if check_finite:
        assert_finite(out, name)
    record(name, out)
    return out


def quantize_reference(x: torch.Tensor, br: int, bc: int, pow2_scale: bool, *, col_major_scales: bool = False,
                       out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec, in plain PyTorch: (codes, scales) of ``x`` (R, C) in (br, bc) blocks.

    ``col_major_scales`` lays the same scales out column-major (see :func:`quantize`); ``out``: (codes,
    scales) to copy the result into, and return.
    """
    if out is not None:
        codes, scales = quantize_reference(x, br, bc, pow2_scale)
        return out[0].copy_(codes), out[1].copy_(scales)
    rows, cols = x.shape
    xf = x.float().contiguous()  # row-major codes even for a transposed view (the wgrad operand)
    pad_rows, pad_cols = -rows % br, -cols % bc
    if pad_rows or pad_cols:
        xf = F.pad(xf, (0, pad_cols, 0, pad_rows))
    xb = xf.view(xf.shape[0] // br, br, xf.shape[1] // bc, bc)  # (Rb, br, Cb, bc)
    amax = xb.abs().amax(dim=(1, 3))  # (Rb, Cb); NaN-propagating
    scales = amax_to_scale(amax, pow2_scale)
    reciprocal = torch.ones_like(scales) / scales  # IEEE reciprocal (see amax_to_scale)
    y = (xb * reciprocal[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
    # a non-finite block is all canonical +NaN (code 0x7F) whatever the sign of its NaN/Inf
    y = torch.where(torch.isnan(scales)[:, None, :, None], torch.full_like(y, float("nan")), y)
    codes = y.to(E4M3).view(xf.shape)[:rows, :cols]
    if col_major_scales:
        scales = scales.t().contiguous().t()
    return (codes.contiguous() if pad_rows or pad_cols else codes), scales


# ---------------------------------------------------------------------------------------
# Backend: one per device type, resolved once, so every caller on a device (trainer, engine,
# export) runs the same code. CPU runs the reference; CUDA runs the Triton kernel
# (jetrl/fp8/kernels/quant_triton.py), which the GPU bench checks bit for bit against the
# reference. Override with JETRL_QUANT_BACKEND=reference|triton.
QUANT_BACKENDS = ("reference", "triton")
_impls: dict[str, Callable] = {}


_backend_by_type: dict[str, str] = {}


def quant_backend(device: torch.device) -> str:
    """The quantizer implementation used on ``device`` (resolved once per device type)."""
    backend = _backend_by_type.get(device.type)
    if backend is None:
        env = env_choice("JETRL_QUANT_BACKEND", QUANT_BACKENDS)
        if env is None:
            from jetrl.fp8.kernels import has_triton

            env = "triton" if device.type == "cuda" and has_triton() else "reference"
        backend = _backend_by_type[device.type] = env
    return backend


def transpose_codes(codes: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``codes.t().contiguous()``, written into ``out`` if given: a tiled Triton transpose where the
    quantizer runs Triton (jetrl/fp8/kernels/transpose_triton.py: the strided copy is slow for one-byte
    elements), the strided copy elsewhere. Bit-identical either way."""
    if quant_backend(codes.device) == "triton" and codes.dim() == 2 and codes.is_contiguous():
        from jetrl.fp8.kernels.transpose_triton import transpose_triton

        return transpose_triton(codes, out)
    return codes.t().contiguous() if out is None else out.copy_(codes.t())


def _implementation(device: torch.device, block: tuple[int, int]) -> Callable:
    backend = quant_backend(device)
    if backend == "triton" and block != (BLOCK, BLOCK) and not (block[0] == 1 and block[1] in (16, 32, 64, 128)):
        backend = "reference"  # group shapes the kernel does not take (the results are the same by spec)
    if backend not in _impls:
        if backend == "triton":
            from jetrl.fp8.kernels.quant_triton import quantize_triton

            _impls[backend] = quantize_triton
        else:
            _impls[backend] = quantize_reference
    return _impls[backend]


def assert_finite(q: Float8Blocks, name: str) -> None:
    """Raise :class:`NonFiniteError` naming ``name`` if any block of ``q`` held a NaN or an Inf."""
    problem = nonfinite_problem(q, name)
    if problem:
        raise NonFiniteError(problem)


def nonfinite_problem(q: Float8Blocks, name: str) -> str | None:
    """What :func:`assert_finite` would raise, or None (one device sync)."""
    bad = ~torch.isfinite(q.scales)
    if not bool(bad.any()):
        return None
    return (f"{name}: {int(bad.sum())} of {bad.numel()} FP8 blocks of shape {q.block} hold NaN/Inf "
            f"(first block indices {bad.nonzero()[:4].tolist()}). FP8 would turn them into NaN codes. Fix the "
            "source: lower the learning rate or enable gradient clipping, or reload the last good checkpoint.")


def _validate(x: torch.Tensor, block: tuple[int, int], name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: quantize expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(
            f"{name}: cannot quantize dtype {x.dtype} to FP8; pass float32, bfloat16 or float16 "
            "(cast with .float() first)"
        )
    if x.dim() != 2 or x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(
            f"{name}: quantize expects a non-empty 2-D tensor (rows, cols), got shape {tuple(x.shape)}; "
            "flatten leading dims with x.reshape(-1, x.shape[-1])"
        )
    if len(block) != 2 or min(block) < 1:
        raise ValueError(f"{name}: block must be two positive ints like (1, 128) or (128, 128), got {block}")


# ---------------------------------------------------------------------------------------
# Recording: a tap that sees every (name, Float8Blocks) the quantizer produces. Used by the
# single-quantizer test and by per-layer diagnosis; free when nobody records.
_RECORDERS: list[list[tuple[str, Float8Blocks]]] = []


def recording() -> bool:
    """Whether a :func:`record_quantization` block is open (a fused kernel then also returns its codes)."""
    return bool(_RECORDERS)


def record(name: str, out: Float8Blocks) -> None:
    """Show the recorders a quantization made outside :func:`quantize` by the quantizer's own arithmetic
    (a fused kernel: kv_quant.py's quantize->dequantize)."""
    for recorder in _RECORDERS:
        recorder.append((name, out))


@contextlib.contextmanager
def record_quantization() -> Iterator[list[tuple[str, Float8Blocks]]]:
    """Collect every quantize() output produced inside the block, in call order."""
    log: list[tuple[str, Float8Blocks]] = []
    _RECORDERS.append(log)
    try:
        yield log
    finally:
        _RECORDERS.remove(log)
