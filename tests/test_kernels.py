"""Triton kernels against their PyTorch references, under TRITON_INTERPRET=1 on CPU.

The interpreter casts fp32 -> e4m3 through numpy, which rounds some elements differently
from torch's RNE cast (design.md §3); the kernel therefore rounds explicitly, and its codes
and scales must equal the reference's bit for bit, here and on the GPU (the bench checks).
"""

import pytest

pytest.importorskip("triton")

from .conftest import compile_for_sm90  # noqa: E402 -- after the skip: needs Triton
from .subprocesses import check_ran, interpret

TRITON_QUANTIZER = {"JETRL_QUANT_BACKEND": "triton"}  # every ``quantize`` takes the Triton kernel too


@pytest.fixture(scope="module")
def interpreted():
    """Every interpreter script of this file, run side by side once (tests/subprocesses.py), the longest (~20 s)
    first; each test checks its own."""
    return interpret({"gemm": (GEMM_SCRIPT, TRITON_QUANTIZER), "quant": SCRIPT, "dual": (DUAL_SCRIPT, TRITON_QUANTIZER),
                      "fake_quant_kv": FAKE_QUANT_KV_SCRIPT, "transpose": (TRANSPOSE_SCRIPT, TRITON_QUANTIZER)})


SCRIPT = r"""
import torch
from jetrl.fp8.quant import quantize_reference
from jetrl.fp8.kernels.quant_triton import quantize_triton

torch.manual_seed(0)
for shape, block, pow2, transpose in [((33, 300), (1, 128), False, False), ((200, 576), (128, 128), False, False),
                                       ((130, 256), (1, 128), True, False), ((256, 70), (1, 128), False, True),
                                       ((300, 260), (128, 128), True, False)]:
    x = torch.randn(shape) * torch.exp(2 * torch.randn(shape))
    x[1, 2] = float("nan")
    x[2, 5], x[2, 6], x[2, 7] = -0.0, float("-inf"), 1e-30
    if transpose:
        x = x.t()  # strided read: the wgrad operand
    ref_codes, ref_scales = quantize_reference(x, *block, pow2)
    codes, scales = quantize_triton(x, *block, pow2)
    assert codes.shape == ref_codes.shape and codes.is_contiguous() and scales.shape == ref_scales.shape
    assert torch.equal(scales.view(torch.int32), ref_scales.view(torch.int32)), (shape, block)
    assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8)), (shape, block, pow2)
    # into given buffers (the weight cache's in-place refresh): the same bits, the same tensors back
    out = (torch.full_like(codes, 1.0), torch.full_like(scales, -1.0).t().contiguous().t())
    got = quantize_triton(x, *block, pow2, out=out)
    assert got[0] is out[0] and got[1] is out[1]
    assert torch.equal(out[0].view(torch.uint8), ref_codes.view(torch.uint8))
    assert torch.equal(out[1].view(torch.int32), ref_scales.view(torch.int32))
print("OK")
"""


def test_quant_kernel_matches_reference_in_interpreter(interpreted):
    check_ran("quant", interpreted["quant"])


DUAL_AND_GEMM_HEADER = r"""
import torch
from jetrl.fp8 import override_backend
from jetrl.fp8.gemm import fp8_gemm, gemm_emulated
from jetrl.fp8.quant import quantize, quantize_reference, quantize_with_transpose
from jetrl.fp8.kernels.quant_triton import quantize_dual_triton, quantize_triton
from jetrl.fp8.kernels.gemm_triton import SmallMConfig, gemm_small_m

def bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t.view(torch.int32)

torch.manual_seed(0)
"""
# in two scripts, run side by side: the dual-layout and narrow-group quantizers, then the small-M GEMM and the rest
DUAL_SCRIPT = DUAL_AND_GEMM_HEADER + r"""
# fused dual-layout quantization == two reference calls, bit for bit (partial tiles, NaN, Inf, pow2)
for shape, pow2, dtype in [((200, 300), False, torch.bfloat16), ((130, 256), True, torch.float32), ((1, 128), False, torch.float32)]:
    x = torch.randn(shape) * torch.exp(2 * torch.randn(shape))
    x[0, 2] = float("nan")
    x[-1, -1] = float("-inf")
    x = x.to(dtype)
    want = (*quantize_reference(x, 1, 128, pow2), *quantize_reference(x.t(), 1, 128, pow2))
    # (chunk, rows): the transposed read's (chunk, 128) column chunks and the row pass's (rows, 128) pieces;
    # (32, 64) is the default; x also as a transposed view (its strides go into the kernel's int32 offsets)
    for chunk, rows, view in [(32, 64, False), (128, 128, False), (64, 32, True)]:
        xin = x.t().contiguous().t() if view else x
        got = quantize_dual_triton(xin, pow2, chunk=chunk, rows=rows)
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.is_contiguous() and torch.equal(bits(g), bits(w)), (shape, chunk, rows)
    # column-major scales (what the training step's GEMMs read): the same values, in that layout
    got = quantize_dual_triton(x, pow2, col_major_scales=True)
    for g, w in zip(got, want):
        assert torch.equal(bits(g.contiguous()), bits(w)), shape
    assert got[1].stride() == (1, shape[0]) and got[3].stride() == (1, shape[1]), (got[1].stride(), got[3].stride())
# the kernel's int32 in-tile offsets: quantize_with_transpose takes two passes where they would overflow
from jetrl.fp8.kernels.quant_triton import dual_fits
assert dual_fits(torch.empty(9216, 24576, device="meta")) and not dual_fits(torch.empty(2**24, 128, device="meta"))
assert not dual_fits(torch.empty(128, 2**24, device="meta").t())
# per-token-head groups narrower than 128 (the KV cache's head_dim)
for width in (16, 64):
    x = torch.randn(70, 3 * width)
    c, s = quantize_triton(x, 1, width, False)
    rc, rs = quantize_reference(x, 1, width, False)
    assert torch.equal(bits(c), bits(rc)) and torch.equal(bits(s), bits(rs)), width
# column-major scales (what cuBLAS's A operand takes): the same values, written in that layout
x = torch.randn(70, 300)
c, s = quantize_triton(x, 1, 128, False, col_major_scales=True)
rc, rs = quantize_reference(x, 1, 128, False)
assert s.stride() == (1, 70) and torch.equal(bits(c), bits(rc)) and torch.equal(s, rs)
q = quantize(x, col_major_scales=True)
assert q.scales.stride() == (1, 70) and torch.equal(q.scales, rs)
print("OK")
"""
GEMM_SCRIPT = DUAL_AND_GEMM_HEADER + r"""
# small-M split-K GEMM vs the emulated spec: M=1 and partial M/N/K, with and without split-K, and
# with the activation scales row- or column-major
for m, n, k, cfg in [(1, 256, 384, None), (20, 200, 300, SmallMConfig(16, 64, 2)), (33, 128, 640, SmallMConfig(32, 64, 4))]:
    for col_major in (False, True):
        a = quantize(torch.randn(m, k), col_major_scales=col_major)
        b = quantize(torch.randn(n, k) * 0.05, (128, 128))
        ref = gemm_emulated(a, b, torch.float32)
        out = gemm_small_m(a.codes, a.scales, b.codes, b.scales, torch.float32, cfg)
        assert out.shape == (m, n) and float((out - ref).norm() / ref.norm()) < 1e-5, (m, n, k, col_major)
# the dispatcher routes to it, and quantize_with_transpose uses the fused kernel under the Triton backend
with override_backend("triton"):
    a, b = quantize(torch.randn(4, 256)), quantize(torch.randn(128, 256), (128, 128))
    assert float((fp8_gemm(a, b, torch.float32) - gemm_emulated(a, b, torch.float32)).abs().max()) < 1e-4
x = torch.randn(96, 256)
fused = quantize_with_transpose(x)
assert torch.equal(bits(fused[1].codes), bits(quantize_reference(x.t(), 1, 128, False)[0]))
# sibling gradients quantized straight into their columns of one stacked dY (out= / out_col=, one launch each):
# the codes and scales of quantizing the concatenation, in both layouts and both scale layouts; a part may be a
# strided view and the last part partial
from jetrl.fp8.quant import quantize_columns_with_transpose
parts = [torch.randn(130, 256), torch.randn(256, 130).t(), torch.randn(130, 100)]
whole = torch.cat(parts, dim=1)
for col_major in (False, True):
    for pow2 in (False, True):
        got = quantize_columns_with_transpose(parts, pow2_scale=pow2, col_major_scales=col_major)
        want = quantize_with_transpose(whole, pow2_scale=pow2, col_major_scales=col_major)
        for g, w in zip(got, want):
            assert g.scales.stride() == w.scales.stride(), (g.scales.stride(), w.scales.stride())
            assert torch.equal(bits(g.codes), bits(w.codes)) and torch.equal(bits(g.scales), bits(w.scales))
out = quantize_dual_triton(whole, False)  # outputs 612 wide: a part may not start off a 128-column group or overrun
for col in (64, 512):
    try:
        quantize_dual_triton(parts[0], False, out=out, out_col=col)
        raise AssertionError(col)
    except ValueError as exc:
        assert "does not fit outputs" in str(exc), exc
print("OK")
"""


def test_dual_quant_and_small_m_gemm_match_references_in_interpreter(interpreted):
    check_ran("dual", interpreted["dual"])
    check_ran("gemm", interpreted["gemm"])


FAKE_QUANT_KV_SCRIPT = r"""
import torch
from jetrl.fp8.kernels.quant_triton import quantize_dequantize_triton
from jetrl.fp8.kv_quant import dequantize_kv
from jetrl.fp8.quant import quantize_reference

torch.manual_seed(0)
def bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])

# deq(q(x)) per head vector == the reference's codes and scales decoded, bit for bit, in x's own layout:
# the trainer's K (B, H, T, D) contiguous, its V a (B, T, H, D) tensor seen transposed; 2-D and 3-D too
cases = [(torch.randn(2, 5, 3, 128).transpose(1, 2), torch.bfloat16, True), (torch.randn(2, 3, 7, 64), torch.float32, False),
         (torch.randn(40, 16), torch.float16, True), (torch.randn(3, 9, 128), torch.bfloat16, False)]
for x, dtype, pow2 in cases:
    x = (x * torch.exp(2 * torch.randn(x.shape))).to(dtype)
    x[(0,) * (x.dim() - 1)][1] = float("nan")
    x[(-1,) * (x.dim() - 1)][2] = float("-inf")
    d = x.shape[-1]
    ref_codes, ref_scales = quantize_reference(x.reshape(-1, d), 1, d, pow2)
    want = dequantize_kv(ref_codes.view(x.shape), ref_scales.view(x.shape[:-1]), dtype)
    for with_codes in (False, True):
        out, codes, scales = quantize_dequantize_triton(x, pow2, with_codes=with_codes)
        assert out.dtype == dtype and out.shape == x.shape and out.stride() == x.stride(), (out.stride(), x.stride())
        nan = want.isnan()  # a group holding NaN/Inf decodes to NaN (whose payload bits are the platform's)
        assert torch.equal(out.isnan(), nan) and nan.any(), (x.shape, dtype)
        assert torch.equal(bits(out)[~nan], bits(want)[~nan]), (x.shape, dtype, pow2)
        if with_codes:
            assert torch.equal(bits(codes), bits(ref_codes)) and torch.equal(bits(scales), bits(ref_scales))
        else:
            assert codes is None and scales is None
    if x.dim() == 4:  # a KV cache's prefill: codes and scales written into (slots, H, max_len) buffers at the slots
        S, L = x.shape[0] + 2, x.shape[2] + 3
        cache_codes = torch.full((S, x.shape[1], L, d), 7, dtype=torch.uint8)
        cache_scales = torch.full((S, x.shape[1], L), -1.0)
        slots = torch.tensor([3, 0][: x.shape[0]] + list(range(4, 4 + x.shape[0] - 2)))
        out, codes, scales = quantize_dequantize_triton(x, pow2, into=(cache_codes, cache_scales, slots))
        assert codes is None and scales is None and out.stride() == x.stride()
        assert torch.equal(bits(out)[~nan], bits(want)[~nan])
        T = x.shape[2]
        assert torch.equal(cache_codes[slots, :, :T], bits(ref_codes).view(x.shape))
        assert torch.equal(bits(cache_scales[slots, :, :T]), bits(ref_scales).view(x.shape[:-1]))
        untouched = torch.ones(S, dtype=torch.bool)
        untouched[slots] = False
        assert (cache_codes[untouched] == 7).all() and (cache_codes[:, :, T:] == 7).all()
        assert (cache_scales[untouched] == -1).all() and (cache_scales[:, :, T:] == -1).all()
print("OK")
"""


def test_fake_quant_kv_kernel_matches_reference_in_interpreter(interpreted):
    check_ran("fake_quant_kv", interpreted["fake_quant_kv"])


def test_gpu_paths_compile_for_hopper():
    """The interpreter runs the EMULATE branches; this compiles the GPU paths (hardware casts, FP8 tensor-core
    dots, both scale layouts' strided stores) of the quantizer, the small-M GEMM, the K/V store and the fused
    model kernels for sm_90, no GPU needed."""
    pytest.importorskip("triton")
    import triton.language as tl

    from jetrl.engine.kernels import kv_store_triton
    from jetrl.fp8.kernels import gemm_triton, quant_triton
    from jetrl.models.kernels import fused_triton

    quant = compile_for_sm90(quant_triton._quantize_kernel,
                             {"GROUP_ROWS": 1, "GROUP_COLS": 128, "TILE_R": 32, "POW2": False, "EXPLICIT_ROUND": False},
                             {"x_ptr": "*bf16", "codes_ptr": "*u8"})
    assert "cvt.rn.satfinite.e4m3x2.f32" in quant.asm["ptx"]
    fake = compile_for_sm90(quant_triton._quantize_dequantize_kernel,
                            {"D": 128, "TILE_R": 32, "POW2": True, "EXPLICIT_ROUND": False, "WRITE_CODES": True,
                             "SLOTS": True},
                            {"x_ptr": "*bf16", "out_ptr": "*bf16", "codes_ptr": "*u8", "slots_ptr": "*i64"})
    assert "cvt.rn.satfinite.e4m3x2.f32" in fake.asm["ptx"] and fake.asm["cubin"]
    gemm = compile_for_sm90(gemm_triton._gemm_small_m_kernel,
                            {"GROUPS_PER_SPLIT": 8, "SPLIT_K": 4, "BLOCK_M": 16, "BLOCK_N": 64},
                            {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "out_ptr": "*bf16", "count_ptr": "*i32"})
    assert gemm.asm["cubin"]
    for fp8 in (False, True):
        cache = "*u8" if fp8 else "*bf16"
        store = compile_for_sm90(kv_store_triton._store_kv_kernel,
                                 {"D": 128, "BLOCK_H": 8, "FP8": fp8, "POW2": False, "EXPLICIT_ROUND": False},
                                 {"k_ptr": "*bf16", "v_ptr": "*bf16", "lengths_ptr": "*i64", "ck_ptr": cache,
                                  "cv_ptr": cache})
        assert store.asm["cubin"]
    prefill = compile_for_sm90(kv_store_triton._store_prefill_kernel, {"D": 128, "TILE_R": 32},
                               {"x_ptr": "*bf16", "buf_ptr": "*bf16", "slots_ptr": "*i64"})
    assert prefill.asm["cubin"]
    bf16 = {"X_DTYPE": tl.bfloat16, "OUT_DTYPE": tl.bfloat16, "EMULATE": False}
    norm = compile_for_sm90(fused_triton._rms_norm_kernel, {"BLOCK_R": 1, "BLOCK_C": 4096, **bf16},
                            {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16"}, floats=("eps",))
    silu = compile_for_sm90(fused_triton._silu_mul_kernel, {"BLOCK": 1024, "DTYPE": tl.bfloat16, "EMULATE": False},
                            {"g_ptr": "*bf16", "u_ptr": "*bf16", "out_ptr": "*bf16"})
    assert norm.asm["cubin"] and silu.asm["cubin"]


def test_pdl_release_only_in_kernels_that_write_no_weight(monkeypatch):
    """The kernels that write a decode GEMM's input release its PDL launch first thing (jetrl/fp8/kernels/pdl.py);
    the 128x128 weight quantization never does, even when asked, so a GEMM never reads a weight before the kernel
    writing it has finished. None of them waits: they are launched plainly. The norms and SwiGLU take the release
    as a runtime flag (one binary in the trainer and the engine), set only up to PDL_MAX_M rows."""
    pytest.importorskip("triton")
    import triton.language as tl

    from jetrl.fp8.kernels import quant_triton
    from jetrl.models.kernels import fused_triton

    def ptx(fn, constexprs, pointers, **kw):
        return compile_for_sm90(fn, constexprs, pointers, **kw).asm["ptx"]

    quant = {"TILE_R": 32, "POW2": False, "EXPLICIT_ROUND": False}
    pointers = {"x_ptr": "*bf16", "codes_ptr": "*u8"}
    bf16 = {"X_DTYPE": tl.bfloat16, "OUT_DTYPE": tl.bfloat16, "EMULATE": False, "ADD": True, "EXPLICIT_ROUND": False}
    for release in (False, True):  # the activation quantization: a constexpr, compiled out where off
        code = ptx(quant_triton._quantize_kernel, {**quant, "GROUP_ROWS": 1, "GROUP_COLS": 128, "RELEASE": release},
                   pointers)
        assert ("griddepcontrol.launch_dependents" in code) == release and "griddepcontrol.wait" not in code
    for gdc in (False, True):  # the norms and SwiGLU: a runtime flag, compiled in only for SM90+ devices (GDC)
        runtime_flag = {
            "rms norm": ptx(fused_triton._rms_norm_kernel, {"BLOCK_R": 1, "BLOCK_C": 4096, **bf16, "GDC": gdc},
                            {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "d_ptr": "*bf16",
                             "h_ptr": "*bf16", "codes_ptr": "*u8"}, floats=("eps",)),
            "swiglu": ptx(fused_triton._silu_mul_kernel, {"BLOCK": 1024, "DTYPE": tl.bfloat16, "EMULATE": False,
                                                          "EXPLICIT_ROUND": False, "GDC": gdc},
                          {"g_ptr": "*bf16", "u_ptr": "*bf16", "out_ptr": "*bf16", "codes_ptr": "*u8"}),
        }
        for name, code in runtime_flag.items():  # ptxas rejects griddepcontrol below sm_90: absent without GDC
            assert code.count("griddepcontrol.launch_dependents") == int(gdc) and "griddepcontrol.wait" not in code, \
                name
    # an Ada GPU (sm_89, the oldest the fused kernels run on: models/fused.py) compiles the norm as it is launched
    # there, GDC off; with the instruction in, ptxas would refuse it
    norm = {"BLOCK_R": 1, "BLOCK_C": 4096, **bf16}
    norm_ptrs = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "d_ptr": "*bf16", "h_ptr": "*bf16",
                 "codes_ptr": "*u8"}
    assert compile_for_sm90(fused_triton._rms_norm_kernel, {**norm, "GDC": False}, norm_ptrs, floats=("eps",),
                            arch=89).asm["cubin"]
    with pytest.raises(Exception, match="griddepcontrol"):
        compile_for_sm90(fused_triton._rms_norm_kernel, {**norm, "GDC": True}, norm_ptrs, floats=("eps",), arch=89)
    # a launch must not specialize early = 1 into a binary of its own (Triton makes an int argument equal to 1 a
    # constexpr unless told not to): the norms' row sums would then be compiled twice
    for kernel in (fused_triton._rms_norm_kernel, fused_triton._silu_mul_kernel):
        flags = {p.name: p.do_not_specialize for p in kernel.params}
        assert flags["early"] and flags["quant"], kernel.fn.__name__
    weight = ptx(quant_triton._quantize_kernel, {**quant, "TILE_R": 128, "GROUP_ROWS": 128, "GROUP_COLS": 128,
                                                 "RELEASE": True}, pointers)
    assert "griddepcontrol" not in weight, "the weight quantization released a PDL GEMM that may read its output"

    import torch

    from jetrl.fp8.kernels import pdl  # the row gate

    cuda = torch.device("cuda", 0)
    cpu = torch.device("cpu")
    assert not pdl.release_rows(cpu, 1) and not pdl.pdl_enabled(cpu) and not pdl.gdc_supported(cpu)
    with pdl.use_pdl(True):  # forcing it cannot turn it on where the device lacks the instruction
        assert not pdl.pdl_enabled(cpu)
    monkeypatch.setattr(pdl, "gdc_supported", lambda device: device.type == "cuda")  # an SM90 device, as it were
    monkeypatch.setenv("JETRL_PDL", "yes")  # read once: a typo is an actionable error, not "off"
    pdl._env_setting.cache_clear()
    try:
        with pytest.raises(ValueError, match="JETRL_PDL='yes' is not a valid choice; use one of 0, 1"):
            pdl.pdl_enabled(cuda)
        monkeypatch.setenv("JETRL_PDL", "0")
        assert not pdl.pdl_enabled(cuda)
        with pdl.use_pdl(True):
            assert pdl.pdl_enabled(cuda)
    finally:
        pdl._env_setting.cache_clear()
    monkeypatch.setattr(pdl, "pdl_enabled", lambda device: True)
    assert pdl.release_rows(cuda, pdl.PDL_MAX_M) and not pdl.release_rows(cuda, pdl.PDL_MAX_M + 1)


TRANSPOSE_SCRIPT = r"""
import torch
from jetrl.fp8.kernels.transpose_triton import transpose_triton
from jetrl.fp8.quant import quantize, transpose_codes
from jetrl.fp8.recipe import get_recipe
from jetrl.fp8.weight_cache import WeightCache

torch.manual_seed(0)
for shape in [(256, 128), (200, 72), (1, 65), (130, 1)]:
    codes = (torch.randn(shape) * 100).to(torch.float8_e4m3fn)
    want = codes.t().contiguous()
    got = transpose_triton(codes)
    assert got.is_contiguous() and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), shape
    out = torch.empty_like(want)
    assert transpose_codes(codes, out=out) is out and torch.equal(out.view(torch.uint8), want.view(torch.uint8))
# the weight cache's W^T after an update, written in place through the kernel
w = torch.nn.Parameter(torch.randn(256, 384))
spec = get_recipe("jet").train.weight
cache = WeightCache("w")
first = cache.get_transposed(w, spec)
with torch.no_grad():
    w.mul_(-3.0)
again = cache.get_transposed(w, spec)
assert again is first
want = quantize(w.detach(), spec.block).codes.t().contiguous()
assert torch.equal(again.codes.view(torch.uint8), want.view(torch.uint8))
try:
    transpose_triton(torch.zeros(4, 4))
    raise SystemExit("a 4-byte tensor was accepted")
except ValueError as e:
    assert "one-byte" in str(e)
print("OK")
"""


def test_code_transpose_matches_reference_in_interpreter(interpreted):
    check_ran("transpose", interpreted["transpose"])


def test_fused_kernels_need_sm89_and_older_gpus_run_pytorch_ops(monkeypatch):
    """The norms' FP8 epilogue is in every call's binary, and Triton has no E4M3 conversion below sm_89: an A100
    must take the PyTorch ops (models/fused.py), not fail to compile."""
    pytest.importorskip("triton")
    from types import SimpleNamespace

    import torch

    from jetrl.fp8 import kernels
    from jetrl.models import fused

    capabilities = {0: (8, 0), 1: (8, 9), 2: (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capabilities[index])
    kernels._capability.cache_clear()
    try:
        on_gpu = [SimpleNamespace(is_cuda=True, device=torch.device("cuda", i)) for i in range(3)]  # a tensor's view
        assert [fused.fused_ops_enabled(x) for x in on_gpu] == [False, True, True]
        assert kernels.capability(torch.device("cuda", 2)) == (9, 0)
    finally:
        kernels._capability.cache_clear()
