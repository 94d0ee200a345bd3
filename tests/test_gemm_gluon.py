"""The Gluon mid-M block-FP8 GEMM (jetrl/fp8/kernels/gemm_gluon.py) against its spec, ``gemm_emulated``.

Gluon has no interpreter, so on CPU the kernel is compiled for sm_90 with Triton's bundled ptxas and
its loop's SASS is checked for what makes it fast (two FP8 ``wgmma`` groups in flight, not
serialized); on an SM90 GPU its results are checked against the emulation.
"""

import pytest
import torch

from jetrl.bench.sass import compile_like_launch
from jetrl.fp8.gemm import gemm_emulated
from jetrl.fp8.quant import BLOCK, quantize

from .conftest import requires_sm90

pytest.importorskip("triton")
gluon_gemm = pytest.importorskip("jetrl.fp8.kernels.gemm_gluon", reason="needs Triton with Gluon (>= 3.6)")

REL_BOUND = 2e-3  # fp32 tensor-core sums within each 128-group, as cuBLAS's block-scaled path


def _compile(cfg, m=256, n=4096, k=12288, col_major_scales=True, pdl=False):
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    def desc(rows, count):
        t = torch.empty(count, k, dtype=torch.float8_e4m3fn)
        layout = gl.NVMMASharedLayout.get_default_for([rows, BLOCK], gl.float8e4nv)
        return TensorDescriptor(t, list(t.shape), list(t.stride()), [rows, BLOCK], layout)

    f32 = torch.empty(1)
    groups = k // BLOCK
    args = {"a_desc": desc(cfg.block_m, m), "b_desc": desc(cfg.block_n, n), "sa_ptr": f32, "sb_ptr": f32,
            "out_ptr": torch.empty(1, dtype=torch.bfloat16), "M": m, "N": n, "K": k,
            "stride_sam": 1 if col_major_scales else groups, "stride_sak": m if col_major_scales else 1,
            "stride_sbn": groups, "stride_om": n}
    constexprs = {"STAGES": cfg.stages, "UNROLL": cfg.unroll, "num_warps": 4, "PDL": pdl}
    return compile_like_launch(gluon_gemm._gemm_kernel, args, constexprs, num_warps=4, num_stages=1)


@pytest.mark.parametrize("cfg", [gluon_gemm.GluonConfig(), gluon_gemm.GluonConfig(128, 128, 4),
                                 gluon_gemm.GluonConfig(64, 64, 6), gluon_gemm.GluonConfig(64, 32, 8, 4)])
def test_loop_keeps_two_wgmma_groups_in_flight(cfg):
    """The consumer's loop issues both groups' QGMMAs, then waits for all but one group (DEPBAR 0x1),
    then for none: ptxas did not serialize the wgmmas (it would put a wait behind every QGMMA)."""
    from jetrl.bench.sass import sass

    code = sass(_compile(cfg))
    qgmma = code.count("QGMMA.64x")
    assert qgmma >= 8, "expected 4 k32 QGMMAs per group, two groups per loop iteration"
    assert code.count("WARPGROUP.DEPBAR.LE gsb0, 0x1") >= 1, "no wait that leaves the second group in flight"
    assert code.count("WARPGROUP.DEPBAR.LE gsb0, 0x0") < qgmma // 4, "ptxas serialized the wgmma pipeline (C7514)"


def test_pdl_launch_reads_only_the_weight_before_its_wait():
    """With PDL (kernels/pdl.py) every partition executes ``griddepcontrol.wait`` and then releases its dependents;
    the first consumer reads no activation tile or scale before its wait, and the producer loads the weight's first
    groups before it, through the weight's descriptor only (a second consumer's prologue is not told apart in the
    PTX and is not checked)."""
    import re

    for cfg in (gluon_gemm.GluonConfig(64, 32, 8, 4), gluon_gemm.GluonConfig(128, 64, 8, 4)):
        ptx = _compile(cfg, m=64 * (cfg.block_m // 64), n=4096, k=4096, pdl=True).asm["ptx"]
        params = dict(re.findall(r"mov\.b64\s+(%rd\d+), _gemm_kernel_param_(\d+);", ptx))
        params.update({dst: params[src] for dst, src in re.findall(r"cvta\.param\.u64\s+(%rd\d+), (%rd\d+);", ptx)
                       if src in params})
        lines = ptx.splitlines()
        waits = [i for i, line in enumerate(lines) if "griddepcontrol.wait" in line]
        order = [line.split(";")[0].strip() for line in lines if "griddepcontrol" in line]
        partitions = cfg.block_m // 64 + 1  # the consumer warpgroups and the producer
        assert order == ["griddepcontrol.wait", "griddepcontrol.launch_dependents"] * partitions, \
            "each partition waits, then releases"
        first = lines[:waits[0]]  # the kernel's prologue and the first consumer partition's
        assert not [line for line in first if "ld.global" in line or "cp.async" in line], "a load before the wait"
        releases = [i for i, line in enumerate(lines) if "griddepcontrol.launch_dependents" in line]
        # the producer partition comes last: from the release before its wait to that wait, only the weight's loads
        producer_prologue = lines[max(r for r in releases if r < waits[-1]):waits[-1]]
        descriptor = re.compile(r"cp\.async\.bulk\.tensor.*\[(%rd\d+), \{")
        early = [descriptor.search(line).group(1) for line in producer_prologue if descriptor.search(line)]
        assert early, "no weight load before the wait: the ring is not filled early"
        loop = [descriptor.search(line).group(1) for line in lines[waits[-1]:] if descriptor.search(line)]
        loaded = {params[r] for r in loop}
        assert len(loaded) == 2 and "0" in loaded, "the producer's loop loads the activation (parameter 0) and weight"
        assert {params[r] for r in early} == loaded - {"0"}, "a load before the wait reads the activation"


def test_an_older_triton_leaves_the_gluon_kernel_out(monkeypatch):
    import triton

    import jetrl.fp8.gemm as gemm

    gemm.has_gluon.cache_clear()
    monkeypatch.setattr(triton, "__version__", "3.5.1")
    try:
        assert not gemm.has_gluon()
        assert gemm.choose_backend(256, (BLOCK, BLOCK), 4096, 4096) == "scaled_mm"
    finally:
        gemm.has_gluon.cache_clear()


def test_rejects_k_not_a_multiple_of_256():
    a = torch.zeros(4, 384, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="multiple of 256"):  # the dispatcher never sends it such a K
        gluon_gemm.gemm_mid_m(a, torch.ones(4, 3), torch.zeros(128, 384, dtype=torch.float8_e4m3fn), torch.ones(1, 3))


def test_misaligned_codes_are_an_actionable_error_and_the_dispatcher_routes_around_them(monkeypatch):
    import jetrl.fp8.gemm as gemm
    from jetrl.fp8.gemm import _gluon_takes

    view = torch.zeros(8, 512 + 16, dtype=torch.float8_e4m3fn)[:, 16:]  # rows 528 B apart, base 16 B in: fine
    rows = torch.zeros(8, 520, dtype=torch.float8_e4m3fn)[:, :512]  # rows 520 B apart: not a multiple of 16
    odd = torch.zeros(8 * 528 + 8, dtype=torch.float8_e4m3fn)[8:].view(8, 528)[:, :512]  # base 8 B off
    w = quantize(torch.randn(128, 512) * 0.02, (BLOCK, BLOCK))
    a = quantize(torch.randn(8, 512))
    assert not _gluon_takes(a, w)  # not a Hopper GPU (here: the CPU)
    monkeypatch.setattr(gemm, "_is_sm90", lambda device: True)
    assert _gluon_takes(a, w)
    assert _gluon_takes(type(a)(view, a.scales, a.block), w)
    assert not _gluon_takes(type(a)(rows, a.scales, a.block), w)
    assert not _gluon_takes(type(a)(odd, a.scales, a.block), w)
    with pytest.raises(ValueError, match="16-byte"):
        gluon_gemm.gemm_mid_m(odd, a.scales, w.codes, w.scales)
    with pytest.raises(ValueError, match="stages"):
        gluon_gemm.GluonConfig(64, 128, stages=20)


@requires_sm90
@pytest.mark.parametrize("m,n,k", [(256, 4096, 4096), (200, 6144, 4096), (128, 384, 12288), (77, 320, 512),
                                   (1, 128, 256), (300, 256, 1024)])
@pytest.mark.parametrize("cfg", [gluon_gemm.GluonConfig(), gluon_gemm.GluonConfig(128, 128, 4),
                                 gluon_gemm.GluonConfig(64, 64, 6), gluon_gemm.GluonConfig(64, 32, 8, 4)])
@pytest.mark.parametrize("col_major", [True, False])
def test_matches_emulation_on_gpu(m, n, k, cfg, col_major):
    torch.manual_seed(m + n + k)
    dev = torch.device("cuda")
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16) * torch.logspace(-2, 2, k, device=dev).to(torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
    a, b = quantize(x, (1, BLOCK), col_major_scales=col_major), quantize(w, (BLOCK, BLOCK))
    ref = gemm_emulated(a, b, torch.float32)
    out = gluon_gemm.gemm_mid_m(a.codes, a.scales, b.codes, b.scales, config=cfg)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    assert float((out.float() - ref).norm() / ref.norm()) < REL_BOUND
    again = gluon_gemm.gemm_mid_m(a.codes, a.scales, b.codes, b.scales, config=cfg)
    assert torch.equal(out, again), "not deterministic run to run"


@requires_sm90
def test_fp8_gemm_dispatches_mid_m_shapes_to_the_gluon_kernel(monkeypatch):
    """On an H200, o_proj at the rollout's M = 256 goes to Gluon (the rule), and its result is the kernel's."""
    import jetrl.fp8.gemm as gemm
    from jetrl.fp8 import fp8_gemm

    calls = []
    real = gluon_gemm.gemm_mid_m
    monkeypatch.setattr(gluon_gemm, "gemm_mid_m", lambda *a, **k: calls.append(1) or real(*a, **k))
    a = quantize(torch.randn(256, 4096, device="cuda"))
    b = quantize(torch.randn(4096, 4096, device="cuda") * 0.02, (BLOCK, BLOCK))
    assert gemm.choose_backend(256, b.block, 4096, 4096) == "gluon"
    out = fp8_gemm(a, b)
    assert calls, "fp8_gemm did not take the Gluon kernel"
    assert torch.equal(out, real(a.codes, a.scales, b.codes, b.scales, config=gemm.gluon_tiles(256, 4096, 4096)))


@requires_sm90
@pytest.mark.parametrize("m,n,k", [(64, 4096, 4096), (256, 4096, 12288), (48, 6144, 4096)])
def test_pdl_gemm_waits_for_the_kernel_that_writes_its_input(m, n, k, monkeypatch):
    """A CUDA graph of the input's quantization (which releases its dependents first thing) and the PDL-launched
    GEMM, replayed with a new input each time: every replay's output is the plain launch's of that input, bit for
    bit (a GEMM that read its input before the quantization finished would return the previous replay's)."""
    from jetrl.fp8.kernels import pdl
    from jetrl.fp8.kernels.pdl import use_pdl
    from jetrl.fp8.kernels.quant_triton import quantize_triton

    dev = torch.device("cuda")
    monkeypatch.setattr(pdl, "PDL_MAX_M", 256)  # the quantization releases at every M of the test
    torch.manual_seed(k)
    w = quantize(torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02, (BLOCK, BLOCK))
    x = torch.empty(m, k, device=dev, dtype=torch.bfloat16)
    codes = torch.empty(m, k, device=dev, dtype=torch.float8_e4m3fn)
    scales = torch.empty(m, k // BLOCK, device=dev)

    def step(on):
        quantize_triton(x, 1, BLOCK, False, out=(codes, scales))  # releases the GEMM early inside use_pdl(True)
        return gluon_gemm.gemm_mid_m(codes, scales, w.codes, w.scales, pdl=on)  # PDL at any M when asked

    inputs = [torch.randn(m, k, device=dev, dtype=torch.bfloat16) * (i + 1) for i in range(6)]
    want = []
    with use_pdl(False):
        for v in inputs:
            x.copy_(v)
            want.append(step(False).clone())
    with use_pdl(True):
        x.copy_(inputs[0])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step(True)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step(True)
    for v, expected in zip(inputs, want):
        x.copy_(v)
        graph.replay()
        assert torch.equal(out, expected)
    for v, expected in zip(inputs, want):  # eager PDL launches too
        x.copy_(v)
        with use_pdl(True):
            assert torch.equal(step(True), expected)


@requires_sm90
def test_eager_calls_keep_no_activation_alive():
    """A TMA descriptor holds its tensor: eager calls with fresh activations (an eager decode, a short prefill) must
    not keep them alive (descriptors cached by tensor once did, one activation per call)."""
    w = quantize(torch.randn(4096, 4096, device="cuda") * 0.02, (BLOCK, BLOCK))

    def call():
        a = quantize(torch.randn(64, 4096, device="cuda"))
        gluon_gemm.gemm_mid_m(a.codes, a.scales, w.codes, w.scales, config=gluon_gemm.GluonConfig())

    call()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
