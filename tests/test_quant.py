"""Property tests of the one quantizer (jetrl.fp8.quant): the formula, bounds, NaN/Inf policy."""

import math

import pytest
import torch

from jetrl.fp8.quant import (
    E4M3_MAX,
    SCALE_FLOOR,
    Float8Blocks,
    NonFiniteError,
    amax_to_scale,
    quantize,
    quantize_columns_with_transpose,
    quantize_with_transpose,
)

BLOCKS = [(1, 128), (128, 128)]


def _random_shape(gen):
    return int(torch.randint(1, 400, (1,), generator=gen)), int(torch.randint(1, 700, (1,), generator=gen))


def _roundtrip_bound(x, q):
    """|x - q*s| <= 2^-4 |x| + 2^-10 s (+ fp32 rounding): see the quant.py docstring."""
    br, bc = q.block
    s = q.scales.repeat_interleave(br, 0)[: x.shape[0]].repeat_interleave(bc, 1)[:, : x.shape[1]]
    return 2.0**-4 * x.abs() * (1 + 2.0**-20) + 2.0**-10 * s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("magnitude", [1.0, 1e-3, 1e4, 3e-39, 1e30])
def test_roundtrip_within_e4m3_bound(dtype, block, magnitude):
    gen = torch.Generator().manual_seed(hash((str(dtype), block, magnitude)) % 2**31)
    for _ in range(4):
        shape = _random_shape(gen)
        # heavy-tailed values so a block spans normal and subnormal E4M3 ranges
        x = (torch.randn(shape, generator=gen) * torch.exp(2 * torch.randn(shape, generator=gen))) * magnitude
        x = x.to(dtype)
        q = quantize(x, block)
        assert q.codes.shape == x.shape and q.codes.dtype == torch.float8_e4m3fn
        assert q.scales.shape == (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))
        assert q.scales.dtype == torch.float32
        assert torch.isfinite(q.scales).all() and (q.scales > 0).all()
        xf = x.float()
        err = (q.dequantize() - xf).abs()
        assert (err <= _roundtrip_bound(xf, q)).all(), float((err - _roundtrip_bound(xf, q)).max())
        # the block's largest element maps to (almost) exactly +-448: the full range is used
        if (q.scales > SCALE_FLOOR).all():  # below the floor (amax < 448 * 2^-126) it cannot be
            assert q.codes.float().abs().max() >= 416


def test_formula_is_multiply_by_reciprocal_of_stored_scale():
    x = torch.randn(3, 256) * 7
    q = quantize(x)
    amax = x.view(3, 2, 128).abs().amax(-1)
    scale = torch.clamp_min(amax / 448.0, SCALE_FLOOR)
    assert torch.equal(q.scales, scale)
    expected = (x.view(3, 2, 128) * (1.0 / scale)[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(q.codes.view(torch.uint8), expected.view(3, 256).view(torch.uint8))


def test_partial_last_group_quantized_as_if_alone():
    x = torch.randn(5, 576)  # SmolLM2: 576 = 4.5 x 128
    q = quantize(x)
    tail = quantize(x[:, 512:].contiguous())
    assert torch.equal(q.codes[:, 512:].view(torch.uint8), tail.codes.view(torch.uint8))
    assert torch.equal(q.scales[:, 4:], tail.scales)
    w = torch.randn(200, 576)
    qw = quantize(w, (128, 128))
    corner = quantize(w[128:, 512:].contiguous(), (128, 128))
    assert qw.scales.shape == (2, 5)
    assert torch.equal(qw.scales[1:, 4:], corner.scales)


def test_zeros_and_tiny_values():
    q = quantize(torch.zeros(4, 300))
    assert (q.codes.float() == 0).all() and torch.equal(q.scales, torch.full((4, 3), SCALE_FLOOR))
    tiny = torch.full((2, 128), 1e-40)  # fp32 subnormal
    qt = quantize(tiny)
    assert torch.isfinite(qt.scales).all() and (qt.scales > 0).all()
    assert ((qt.dequantize() - tiny).abs() <= 2.0**-10 * qt.scales).all()


def test_huge_values_no_overflow():
    x = torch.tensor([[3.0e38, -3.0e38] + [1.0] * 126])
    q = quantize(x)
    assert torch.isfinite(q.scales).all()
    assert q.codes.float()[0, 0] == 448 and q.codes.float()[0, 1] == -448
    assert torch.isfinite(q.dequantize()).all()


def test_pow2_scales_are_exact_powers_of_two_and_cover_amax():
    amax = torch.tensor([0.0, 1e-30, 1.0, 447.9, 448.0, 448.1, 3e38])
    s = amax_to_scale(amax, pow2_scale=True)
    mantissa, _ = torch.frexp(s)
    assert (mantissa == 0.5).all()  # exact powers of two
    assert (s * E4M3_MAX >= amax).all()  # nothing saturates
    assert (s / 2 * E4M3_MAX < torch.clamp_min(amax, SCALE_FLOOR * E4M3_MAX)).all()  # the smallest such power
    x = torch.randn(64, 384)
    q = quantize(x, pow2_scale=True)
    assert ((q.dequantize() - x).abs() <= _roundtrip_bound(x, q)).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_propagates_as_nan_never_saturates(bad):
    x = torch.randn(3, 256)
    x[1, 130] = bad
    q = quantize(x)
    assert torch.isnan(q.scales[1, 1]) and torch.isfinite(q.scales[[0, 2]]).all()
    assert torch.isfinite(q.scales[1, 0])  # other groups of the row are untouched
    group = q.codes[1, 128:256].float()
    assert torch.isnan(group).all(), "a non-finite group must become NaN codes, not +-448"
    assert torch.isnan(q.dequantize()[1, 128:]).all()
    with pytest.raises(NonFiniteError, match="layer.7.input"):
        quantize(x, check_finite=True, name="layer.7.input")


def test_transpose_reuses_codes():
    w = torch.randn(300, 200)
    q = quantize(w, (128, 128))
    qt = q.t()
    assert torch.equal(qt.codes.view(torch.uint8), q.codes.t().contiguous().view(torch.uint8))
    assert torch.equal(qt.dequantize(), q.dequantize().t())
    # quantizing W^T from scratch gives the same codes for square blocks
    fresh = quantize(w.t().contiguous(), (128, 128))
    assert torch.equal(fresh.codes.view(torch.uint8), qt.codes.view(torch.uint8))
    # a weight one block tall: W^T's (k, 1) scales are row-major, as the GEMM kernels read them
    flat = quantize(torch.randn(128, 384), (128, 128)).t()
    assert flat.scales.shape == (3, 1) and flat.scales.stride() == (1, 1)


@pytest.mark.parametrize(
    "x, block, err, match",
    [
        (torch.randn(4, 4).to(torch.int32), (1, 128), TypeError, "act.*int32"),
        (torch.randn(2, 3, 4), (1, 128), ValueError, "act.*2-D.*reshape"),
        (torch.randn(0, 128), (1, 128), ValueError, "act.*non-empty"),
        (torch.randn(4, 128), (0, 128), ValueError, "act.*block"),
    ],
)
def test_bad_input_names_the_tensor(x, block, err, match):
    with pytest.raises(err, match=match):
        quantize(x, block, name="act")


def test_float8blocks_dequantize_dtype():
    q = quantize(torch.randn(2, 128))
    assert isinstance(q, Float8Blocks) and q.dequantize(torch.bfloat16).dtype == torch.bfloat16


def test_quant_backend_env_var_must_name_a_backend(monkeypatch):
    """A bad JETRL_QUANT_BACKEND is an actionable error naming the variable and the choices
    (overrides.env_choice, shared by every backend variable); a valid one is taken as is."""
    import jetrl.fp8.quant as quant_module

    monkeypatch.setattr(quant_module, "_backend_by_type", {})
    monkeypatch.setenv("JETRL_QUANT_BACKEND", "fast")
    with pytest.raises(ValueError, match=r"JETRL_QUANT_BACKEND='fast' is not a valid choice; use one of "
                                         r"reference, triton, or unset JETRL_QUANT_BACKEND"):
        quant_module.quant_backend(torch.device("cpu"))
    monkeypatch.setenv("JETRL_QUANT_BACKEND", "reference")
    assert quant_module.quant_backend(torch.device("cpu")) == "reference"


def test_bare_cast_only_where_codes_go_straight_to_memory():
    """The GPU's bare E4M3 cast (no clamp, no NaN select before it) is exact only where its codes are stored as
    they come: Triton 3.6 miscompiles their in-register use (bench/probe_bare_cast.py, docs/benchmarks.md (a)). So
    only the two quantize kernels may pass ``BARE_CAST=True``; a kernel that decodes, reshapes or moves its codes
    must call ``quantize_rows`` (re-run the probe on the GPU before widening this list)."""
    import ast
    import pathlib

    import jetrl

    users = set()
    for path in pathlib.Path(jetrl.__file__).parent.rglob("*.py"):
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, ast.FunctionDef):
                continue
            for call in ast.walk(fn):
                if (isinstance(call, ast.Call) and getattr(call.func, "id", getattr(call.func, "attr", None))
                        in ("_quantize_rows", "_code_bits")
                        and any(isinstance(a, ast.Constant) and a.value is True for a in call.args)):
                    users.add((path.name, fn.name))
    assert users == {("quant_triton.py", "_quantize_kernel"), ("quant_triton.py", "_quantize_dual_kernel")}, users


def test_quantize_with_transpose_column_major_scales_hold_the_same_values():
    x = torch.randn(200, 300)
    want = quantize_with_transpose(x, pow2_scale=True)
    got = quantize_with_transpose(x, pow2_scale=True, col_major_scales=True)
    for g, w in zip(got, want):
        assert torch.equal(g.codes.view(torch.uint8), w.codes.view(torch.uint8)) and torch.equal(g.scales, w.scales)
        assert g.scales.stride() == (1, g.scales.shape[0]), g.scales.stride()


def test_quantize_columns_with_transpose_is_the_concatenation():
    """Sibling gradients quantized as one stacked operand: the codes and scales of quantizing their concatenation
    (here the reference backend; the Triton kernel's column-offset writes in tests/test_kernels.py); parts that
    cannot stack are an actionable error."""
    torch.manual_seed(0)
    parts = [torch.randn(40, 256), torch.randn(40, 128), torch.randn(40, 70)]
    got = quantize_columns_with_transpose(parts, pow2_scale=True)
    want = quantize_with_transpose(torch.cat(parts, dim=1), pow2_scale=True)
    for g, w in zip(got, want):
        assert torch.equal(g.codes.view(torch.uint8), w.codes.view(torch.uint8)) and torch.equal(g.scales, w.scales)
    for bad in ([torch.randn(40, 100), torch.randn(40, 128)], [torch.randn(40, 128), torch.randn(39, 128)]):
        with pytest.raises(ValueError, match="parts must share their rows"):
            quantize_columns_with_transpose(bad)
