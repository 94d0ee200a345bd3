"""FP8 GEMM dispatch: the emulation against an independent reference; backends; bad operands."""

import pytest
import torch

from jetrl.fp8 import fp8_gemm, gemm_emulated, override_backend, quantize, resolve_backend
from jetrl.fp8.gemm import BACKENDS

from .conftest import requires_sm90


def _reference_nt(a, b):
    """Independent spec: decode every E4M3 code by its bit fields, scale each block, matmul in float64."""

    def decode(q):
        bits = q.codes.view(torch.uint8).long()
        sign = 1 - 2 * ((bits >> 7) & 1)
        exp, man = (bits >> 3) & 0xF, bits & 0x7
        normal = (1 + man / 8.0) * torch.pow(2.0, (exp - 7).double())
        sub = (man / 8.0) * 2.0**-6
        vals = sign * torch.where(exp == 0, sub, normal)
        out = torch.empty(q.shape, dtype=torch.float64)
        br, bc = q.block
        for i in range(q.scales.shape[0]):
            for j in range(q.scales.shape[1]):
                blk = (slice(i * br, (i + 1) * br), slice(j * bc, (j + 1) * bc))
                out[blk] = vals[blk] * q.scales[i, j].double()
        return out

    return decode(a) @ decode(b).t()


@pytest.mark.parametrize("m, n, k", [(1, 16, 128), (37, 200, 576), (130, 256, 384)])
@pytest.mark.parametrize("b_block", [(128, 128), (1, 128)])
def test_emulated_matches_independent_reference(m, n, k, b_block):
    gen = torch.Generator().manual_seed(m * n + k)
    a = quantize(torch.randn(m, k, generator=gen))
    b = quantize(torch.randn(n, k, generator=gen) * 0.02, b_block)
    out = gemm_emulated(a, b, torch.float32)
    ref = _reference_nt(a, b)
    # dequantization is exact in fp32; only the fp32 accumulation rounds: |err| <= k * 2^-24 * sum|a||b|
    bound = k * 2.0**-24 * (a.dequantize().double().abs() @ b.dequantize().double().abs().t())
    assert ((out.double() - ref).abs() <= bound + 1e-30).all()
    assert out.shape == (m, n)


def test_emulated_gemm_rows_do_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(1)
    a = quantize(torch.randn(64, 576, generator=gen))
    b = quantize(torch.randn(1536, 576, generator=gen), (128, 128))
    full = fp8_gemm(a, b, torch.float32)
    rows = torch.cat([fp8_gemm(quantize(a.dequantize()[i:i + 1]), b, torch.float32) for i in range(64)])
    assert torch.equal(full, rows)


def test_dispatch_uses_emulation_on_cpu_and_override_is_scoped():
    assert resolve_backend("cpu") == "emulated"
    with override_backend("emulated"):
        assert resolve_backend("cuda") == "emulated"
    with pytest.raises(ValueError, match="unknown FP8 GEMM backend"):
        with override_backend("cutlass"):
            pass
    assert set(BACKENDS) == {"emulated", "scaled_mm", "triton", "gluon"}


def test_per_shape_choice_is_a_fixed_rule(monkeypatch):
    import jetrl.fp8.gemm as gemm
    from jetrl.fp8.gemm import SMALL_M_MAX, choose_backend, gluon_tiles

    for m in (1, 16, SMALL_M_MAX):
        assert choose_backend(m) == "triton"  # M alone: the Triton kernel up to 64 rows
    assert choose_backend(SMALL_M_MAX + 1) == "scaled_mm"
    assert choose_backend(8192) == "scaled_mm"
    assert choose_backend(16, (1, 128)) == "scaled_mm"  # wgrad operands: cuBLAS only
    # with the shape: the 8B layer's GEMMs (N, K) = qkv, o, gate_up, down, as bench/sweep_gemm_gluon.py chose
    monkeypatch.setattr(gemm, "has_gluon", lambda: True)
    qkv, o, gate_up, down = (6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)
    expect = {16: ("triton",) * 4, 32: ("gluon", "gluon", "gluon", "triton"), 64: ("gluon",) * 4,
              128: ("gluon", "gluon", "scaled_mm", "gluon"), 256: ("scaled_mm", "gluon", "scaled_mm", "gluon"),
              8192: ("scaled_mm",) * 4}
    for m, picks in expect.items():
        assert tuple(choose_backend(m, (128, 128), n, k) for n, k in (qkv, o, gate_up, down)) == picks, m
    assert choose_backend(64, (128, 128), 4096, 4096 + 128) == "triton"  # K not a multiple of 256
    assert gluon_tiles(256, *down) == gluon_tiles(256, *down)  # a pure function of the shape
    # at M <= 64 narrow layers (o, down) take 32-wide tiles: 128 CTAs stream the weight instead of 64
    assert [gluon_tiles(64, *s).block_n for s in (qkv, o, gate_up, down)] == [64, 32, 64, 32]
    assert choose_backend(64, (128, 128), 24576, 12288) == "triton"  # wide and long: Triton's split-K
    # a small weight (Qwen3-0.6B's layers, 1.7B's o) takes Gluon at every M up to 64: its fixed cost is lower
    small = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (2048, 2048)]
    assert {choose_backend(m, (128, 128), n, k) for m in (1, 16, 32, 64) for n, k in small} == {"gluon"}
    assert choose_backend(1, (128, 128), 4096, 2048) == "triton"  # 1.7B's qkv: 8M elements, Triton at M = 1
    assert choose_backend(32, (128, 128), 2560, 9728) == "triton"  # 4B's down: a long K keeps Triton at M = 32
    monkeypatch.setattr(gemm, "has_gluon", lambda: False)
    assert choose_backend(256, (128, 128), *o) == "scaled_mm" and choose_backend(64, (128, 128), *o) == "triton"


@pytest.mark.parametrize("name", ["scaled_mm", "triton", "gluon"])
def test_env_backend_the_device_cannot_run_is_an_actionable_error(monkeypatch, name):
    import jetrl.fp8.gemm as gemm

    monkeypatch.setattr(gemm, "_resolved", {})
    monkeypatch.setenv("JETRL_GEMM_BACKEND", name)
    with pytest.raises(ValueError, match="needs an SM90"):
        resolve_backend("cpu")


def test_env_auto_means_the_emulation_off_sm90(monkeypatch):
    import jetrl.fp8.gemm as gemm

    monkeypatch.setattr(gemm, "_resolved", {})
    monkeypatch.setenv("JETRL_GEMM_BACKEND", "auto")
    assert resolve_backend("cpu") == "emulated"


def test_env_var_must_name_a_backend(monkeypatch):
    import jetrl.fp8.gemm as gemm

    monkeypatch.setattr(gemm, "_resolved", {})
    monkeypatch.setenv("JETRL_GEMM_BACKEND", "fast")
    with pytest.raises(ValueError, match="JETRL_GEMM_BACKEND"):
        resolve_backend("cpu")


def test_bad_operands_get_clear_errors():
    a = quantize(torch.randn(4, 256))
    with pytest.raises(ValueError, match="contraction dims differ"):
        fp8_gemm(a, quantize(torch.randn(8, 128), (128, 128)))
    with pytest.raises(ValueError, match="operand a must be quantized in"):
        fp8_gemm(quantize(torch.randn(4, 256), (128, 128)), quantize(torch.randn(8, 256), (128, 128)))


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(1, 4096, 4096), (256, 1536, 576), (8192, 4096, 4096)])
@pytest.mark.parametrize("b_block", [(128, 128), (1, 128)])
@pytest.mark.parametrize("col_major", [False, True])
def test_scaled_mm_agrees_with_emulation(m, n, k, b_block, col_major):
    a = quantize(torch.randn(m, k, device="cuda"), col_major_scales=col_major)
    b = quantize(torch.randn(n, k, device="cuda") * 0.02, b_block)
    with override_backend("scaled_mm"):
        fast = fp8_gemm(a, b, torch.float32)
    spec = gemm_emulated(a, b, torch.float32)
    rel = (fast - spec).norm() / spec.norm()
    assert rel < 5e-3, rel


@requires_sm90
def test_small_m_split_k_gemm_is_deterministic_and_leaves_counters_zero():
    """The in-kernel split-K reduction: bitwise the same result on every call (new inputs each time,
    a NaN-poisoned allocator so a stale partial would show), close to the spec, counters back at 0."""
    from jetrl.fp8.kernels.gemm_triton import SmallMConfig, gemm_small_m
    from jetrl.fp8.kernels.split_k import _counters

    torch.manual_seed(0)
    for m, n, k, split in [(1, 4096, 4096, 4), (16, 6144, 4096, 8), (64, 4096, 12288, 8)]:
        b = quantize(torch.randn(n, k, device="cuda") * 0.02, (128, 128))
        cfg = SmallMConfig(16 if m <= 16 else 64, 64, split)
        for trial in range(5):
            a = quantize(torch.randn(m, k, device="cuda"))
            torch.empty(split * m * n * 4, dtype=torch.float32, device="cuda").fill_(float("nan"))  # poison
            first = gemm_small_m(a.codes, a.scales, b.codes, b.scales, torch.float32, cfg)
            for _ in range(20):
                again = gemm_small_m(a.codes, a.scales, b.codes, b.scales, torch.float32, cfg)
                assert torch.equal(again, first), (m, n, k, trial)
            spec = gemm_emulated(a, b, torch.float32)
            assert float((first - spec).norm() / spec.norm()) < 5e-4  # H200: 1e-7 (mma), 1.3e-4 (wgmma, M=64)
        assert int(_counters[torch.device("cuda", torch.cuda.current_device())].abs().sum()) == 0
