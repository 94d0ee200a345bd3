"""Fused RMSNorm / RoPE / SwiGLU kernels against their references (jetrl/models/fused.py).

On CPU the model always runs the references; the Triton kernels are checked here under
``TRITON_INTERPRET=1``: RoPE bit for bit (it has no reduction), RMSNorm within one ulp of the
model dtype (its row sum may be ordered differently) and batch-invariant, SwiGLU bit for bit in
bf16 (in fp32 within 4e-7 relative: the CPU reference's vectorized exp is not numpy's); the
autograd wrappers give the references' gradients (their backward kernels, one by one:
tests/test_fused_backward.py).
"""


import pytest
import torch

from jetrl.models.fused import (
    apply_rope_reference,
    fused_ops_enabled,
    fused_ops_requested,
    rms_norm_reference,
    use_fused_ops,
)

from .subprocesses import check_ran, interpret

SCRIPT = r"""
import torch
from jetrl.models.fused import (_FusedAddRMSNorm, _FusedNormRoPE, _FusedRMSNorm, _FusedRoPE, _FusedSiluMul,
                                apply_rope_reference, rms_norm_reference, silu_mul_reference)
from jetrl.models.kernels.fused_triton import (add_rms_norm_triton, apply_rope_triton, norm_rope_triton,
                                               rms_norm_triton, silu_mul_triton)


def close(got, ref, ulps):  # within `ulps` units of the dtype's last place, relative to the tensor's scale
    ulp = 2.0 ** -7 if ref.dtype == torch.bfloat16 else 2.0 ** -20
    return float((got.float() - ref.float()).abs().max()) <= ulps * ulp * float(ref.float().abs().max())


torch.manual_seed(0)
for dtype, wdtype in [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32), (torch.bfloat16, torch.float32)]:
    for shape in [(3, 5, 128), (2, 576), (4, 2, 3, 64)]:
        x = (torch.randn(shape) * 3).to(dtype)
        w = (1 + 0.1 * torch.randn(shape[-1])).to(wdtype)
        ref, got = rms_norm_reference(x, w, 1e-6), rms_norm_triton(x, w, 1e-6)
        assert got.dtype == ref.dtype and got.shape == ref.shape, (got.dtype, ref.dtype)
        ulp = 2.0 ** -7 if ref.dtype == torch.bfloat16 else 2.0 ** -20
        assert float(((got.float() - ref.float()).abs() / ref.float().abs().clamp_min(1e-3)).max()) <= ulp, shape
        # batch invariance: a row alone gives the same bits as inside the batch
        x2 = x.reshape(-1, shape[-1])
        assert torch.equal(rms_norm_triton(x2[1:2], w, 1e-6), rms_norm_triton(x2, w, 1e-6)[1:2])
# strided inputs, as column slices of one stacked GEMM output (q/k of a q|k|v buffer, gate/up of gate|up)
buf = torch.randn(2, 3, 6 * 64).to(torch.bfloat16)
x = buf[..., 64:320].view(2, 3, 4, 64)
w = (1 + 0.1 * torch.randn(64)).to(torch.bfloat16)
got = rms_norm_triton(x, w, 1e-6)
assert got.is_contiguous() and torch.equal(got, rms_norm_triton(x.contiguous(), w, 1e-6))
ref = rms_norm_reference(x, w, 1e-6)
assert float(((got.float() - ref.float()).abs() / ref.float().abs().clamp_min(1e-3)).max()) <= 2.0 ** -7
gu = (torch.randn(5, 2, 600) * 3).to(torch.bfloat16)
assert torch.equal(silu_mul_triton(gu[..., :300], gu[..., 300:]), silu_mul_reference(gu[..., :300], gu[..., 300:]))
for dtype in (torch.bfloat16, torch.float32):
    for B, H, T, D, cos_batch in [(2, 4, 5, 64, 2), (3, 2, 1, 128, 3), (2, 3, 4, 32, 1)]:
        q = torch.randn(B, T, H, D).to(dtype).transpose(1, 2)  # the model's strided (B, H, T, D) view
        ang = torch.randn(cos_batch, T, D // 2).repeat(1, 1, 2)
        cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
        ref, got = apply_rope_reference(q, cos, sin), apply_rope_triton(q, cos, sin)
        assert got.stride() == q.stride() or got.is_contiguous()
        assert torch.equal(got, ref), (dtype, B, H, T, D)
for dtype, tol in ((torch.bfloat16, 0.0), (torch.float32, 4e-7)):
    g, u = (torch.randn(3, 5, 1000) * 4).to(dtype), torch.randn(3, 5, 1000).to(dtype)
    ref, got = silu_mul_reference(g, u), silu_mul_triton(g, u)
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert float(((got.float() - ref.float()).abs() / ref.float().abs().clamp_min(1e-3)).max()) <= tol, dtype
# gradients: the autograd wrappers give the references' gradients
g, u = torch.randn(4, 300, requires_grad=True), torch.randn(4, 300, requires_grad=True)
gs = torch.randn(4, 300)
ga, ua = torch.autograd.grad(_FusedSiluMul.apply(g, u), (g, u), gs)
gr, ur = torch.autograd.grad(silu_mul_reference(g, u), (g, u), gs)
assert torch.allclose(ga, gr, atol=1e-6) and torch.allclose(ua, ur, atol=1e-6)
x = torch.randn(4, 256, requires_grad=True)
w = (1 + 0.1 * torch.randn(256)).requires_grad_()
gy = torch.randn(4, 256)
gx, gw = torch.autograd.grad(_FusedRMSNorm.apply(x, w, 1e-6), (x, w), gy)
rx, rw = torch.autograd.grad(rms_norm_reference(x, w, 1e-6), (x, w), gy)
assert torch.allclose(gx, rx, atol=1e-6) and torch.allclose(gw, rw, atol=1e-5)
q = torch.randn(2, 3, 4, 64, requires_grad=True)
ang = torch.randn(2, 4, 32).repeat(1, 1, 2)
gq = torch.randn(2, 3, 4, 64)
(g1,) = torch.autograd.grad(_FusedRoPE.apply(q, ang.cos(), ang.sin()), (q,), gq)
(g2,) = torch.autograd.grad(apply_rope_reference(q, ang.cos(), ang.sin()), (q,), gq)
assert torch.allclose(g1, g2, atol=1e-6)
# residual add + RMSNorm in one kernel: h bit-equal to x + d, y within 2 ulps of the reference, batch-invariant
for dtype in (torch.bfloat16, torch.float32):
    x, d = (torch.randn(3, 5, 576) * 3).to(dtype), torch.randn(3, 5, 576).to(dtype)
    w = (1 + 0.1 * torch.randn(576)).to(dtype)
    h, y = add_rms_norm_triton(x, d, w, 1e-6)
    assert torch.equal(h, x + d) and h.is_contiguous() and y.is_contiguous()
    assert close(y, rms_norm_reference(x + d, w, 1e-6), 2), dtype
    h1, y1 = add_rms_norm_triton(x[1:2, 2:3], d[1:2, 2:3], w, 1e-6)
    assert torch.equal(y1, y[1:2, 2:3]) and torch.equal(h1, h[1:2, 2:3])
# q/k-norm + RoPE in one launch: RoPE alone bit for bit; with the norm within ulps of the ops one by one,
# batch-invariant, strided q/k (column slices of a q|k|v buffer) read in place
for dtype in (torch.bfloat16, torch.float32):
    for B, T, Hq, Hk, D, cos_batch in [(2, 5, 4, 2, 64, 2), (3, 1, 8, 2, 128, 3), (1, 3, 2, 1, 32, 1)]:
        qkv = torch.randn(B, T, (Hq + 2 * Hk) * D).to(dtype) * 2
        q, k = qkv[..., :Hq * D].view(B, T, Hq, D), qkv[..., Hq * D:(Hq + Hk) * D].view(B, T, Hk, D)
        ang = torch.randn(cos_batch, T, D // 2).repeat(1, 1, 2)
        cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
        qo, ko = norm_rope_triton(q, k, None, None, 0.0, cos, sin)
        assert qo.shape == (B, Hq, T, D) and qo.transpose(1, 2).is_contiguous()
        assert torch.equal(qo, apply_rope_reference(q.transpose(1, 2), cos, sin))
        assert torch.equal(ko, apply_rope_reference(k.transpose(1, 2), cos, sin))
        qw, kw = (1 + 0.1 * torch.randn(D)).to(dtype), (1 + 0.1 * torch.randn(D)).to(dtype)
        qo, ko = norm_rope_triton(q, k, qw, kw, 1e-6, cos, sin)
        for got, x, w in ((qo, q, qw), (ko, k, kw)):
            ref = apply_rope_reference(rms_norm_reference(x, w, 1e-6).transpose(1, 2), cos, sin)
            assert close(got, ref, 4), (dtype, B, T, D)
        q2, k2 = norm_rope_triton(q.contiguous(), k.contiguous(), qw, kw, 1e-6, cos, sin)
        assert torch.equal(q2, qo) and torch.equal(k2, ko)
        if cos_batch == B:  # one row alone: the same bits
            q1, k1 = norm_rope_triton(q[-1:], k[-1:], qw, kw, 1e-6, cos[-1:], sin[-1:])
            assert torch.equal(q1, qo[-1:]) and torch.equal(k1, ko[-1:])
# their autograd wrappers give the references' gradients
x, d = torch.randn(4, 256, requires_grad=True), torch.randn(4, 256, requires_grad=True)
w = (1 + 0.1 * torch.randn(256)).requires_grad_()
gh, gy = torch.randn(4, 256), torch.randn(4, 256)
h, y = _FusedAddRMSNorm.apply(x, d, w, 1e-6)
got = torch.autograd.grad((h * gh).sum() + (y * gy).sum(), (x, d, w))
h = x + d
ref = torch.autograd.grad((h * gh).sum() + (rms_norm_reference(h, w, 1e-6) * gy).sum(), (x, d, w))
assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, ref))
q = torch.randn(2, 4, 3, 64, requires_grad=True)
k = torch.randn(2, 4, 1, 64, requires_grad=True)
qw, kw = (1 + 0.1 * torch.randn(64)).requires_grad_(), (1 + 0.1 * torch.randn(64)).requires_grad_()
ang = torch.randn(2, 4, 32).repeat(1, 1, 2)
gq, gk = torch.randn(2, 3, 4, 64), torch.randn(2, 1, 4, 64)
qo, ko = _FusedNormRoPE.apply(q, k, qw, kw, 1e-6, ang.cos(), ang.sin())
got = torch.autograd.grad((qo * gq).sum() + (ko * gk).sum(), (q, k, qw, kw))
qr = apply_rope_reference(rms_norm_reference(q, qw, 1e-6).transpose(1, 2), ang.cos(), ang.sin())
kr = apply_rope_reference(rms_norm_reference(k, kw, 1e-6).transpose(1, 2), ang.cos(), ang.sin())
ref = torch.autograd.grad((qr * gq).sum() + (kr * gk).sum(), (q, k, qw, kw))
assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, ref)), [float((a - b).abs().max()) for a, b in zip(got, ref)]
# bf16, q/k as column slices of a q|k|v buffer (the model's layout), a batch-1 cos/sin table
qkv = torch.randn(2, 4, 6 * 64).bfloat16().requires_grad_()
qs, ks = qkv[..., :256].view(2, 4, 4, 64), qkv[..., 256:320].view(2, 4, 1, 64)
qw16, kw16 = ((1 + 0.1 * torch.randn(64)).bfloat16().requires_grad_() for _ in range(2))
c16, s16 = ang[:1].cos().bfloat16(), ang[:1].sin().bfloat16()
g16q, g16k = torch.randn(2, 4, 4, 64).bfloat16(), torch.randn(2, 1, 4, 64).bfloat16()
qo, ko = _FusedNormRoPE.apply(qs, ks, qw16, kw16, 1e-6, c16, s16)
assert torch.equal(qo, norm_rope_triton(qs, ks, qw16, kw16, 1e-6, c16, s16)[0])  # autograd runs the same kernel
got = torch.autograd.grad((qo.float() * g16q.float()).sum() + (ko.float() * g16k.float()).sum(), (qkv, qw16, kw16))
qr = apply_rope_reference(rms_norm_reference(qs, qw16, 1e-6).transpose(1, 2), c16, s16)
kr = apply_rope_reference(rms_norm_reference(ks, kw16, 1e-6).transpose(1, 2), c16, s16)
ref = torch.autograd.grad((qr.float() * g16q.float()).sum() + (kr.float() * g16k.float()).sum(), (qkv, qw16, kw16))
for a, b in zip(got, ref):
    assert close(a, b, 4), float((a.float() - b.float()).abs().max())
qo, ko = _FusedNormRoPE.apply(q, k, None, None, 0.0, ang.cos(), ang.sin())  # no q/k norm (Llama): RoPE only
got = torch.autograd.grad((qo * gq).sum() + (ko * gk).sum(), (q, k))
ref = torch.autograd.grad((apply_rope_reference(q.transpose(1, 2), ang.cos(), ang.sin()) * gq).sum()
                          + (apply_rope_reference(k.transpose(1, 2), ang.cos(), ang.sin()) * gk).sum(), (q, k))
assert all(torch.equal(a, b) for a, b in zip(got, ref))
print("OK")
"""


@pytest.fixture(scope="module")
def interpreted():
    """This file's two interpreter scripts, run side by side once (tests/subprocesses.py); each test checks its
    own."""
    pytest.importorskip("triton")
    return interpret({"fused": SCRIPT, "producer_quant": PRODUCER_QUANT_SCRIPT})


def test_fused_kernels_match_references_in_interpreter(interpreted):
    check_ran("fused", interpreted["fused"])


PRODUCER_QUANT_SCRIPT = r"""
import torch
from jetrl.fp8.quant import E4M3, quantize_reference
from jetrl.models.fused import QuantizedOutput
from jetrl.models.kernels.fused_triton import add_rms_norm_triton, rms_norm_triton, silu_mul_triton


def buffers(rows, cols, pow2):  # as jetrl.fp8.producer_quant lays them out: column-major scales
    return QuantizedOutput(torch.full((rows, cols), 3.0).to(E4M3), torch.full((cols // 128, rows), -1.0).t(), pow2)


def check(y, q, pow2):  # the codes and scales are quantize(y)'s, bit for bit
    codes, scales = quantize_reference(y.reshape(-1, y.shape[-1]), 1, 128, pow2)
    assert torch.equal(q.codes.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(q.scales.view(torch.int32), scales.view(torch.int32))


torch.manual_seed(0)
for pow2 in (False, True):
    for rows, cols in ((5, 256), (3, 384), (2, 128)):  # 384: a 512-wide tile with a masked group
        x = (torch.randn(rows, cols) * torch.exp(torch.randn(rows, 1))).bfloat16()
        x[1, 3] = float("nan") if cols == 384 else x[1, 3]  # a NaN group: scale NaN, codes 0x7F, as quantize does
        w = (1 + 0.1 * torch.randn(cols)).bfloat16()
        q = buffers(rows, cols, pow2)
        y = rms_norm_triton(x, w, 1e-6, q)
        assert torch.equal(y.view(torch.int16), rms_norm_triton(x, w, 1e-6).view(torch.int16))  # y unchanged
        check(y, q, pow2)
        d = torch.randn(rows, cols).bfloat16()
        q = buffers(rows, cols, pow2)
        h, y = add_rms_norm_triton(x, d, w, 1e-6, q)
        assert torch.equal(y.view(torch.int16), add_rms_norm_triton(x, d, w, 1e-6)[1].view(torch.int16))
        check(y, q, pow2)
    g, u = (torch.randn(3, 2, 1280) * 4).bfloat16(), torch.randn(3, 2, 1280).bfloat16()  # 2 column blocks, 1 partial
    q = buffers(6, 1280, pow2)
    y = silu_mul_triton(g, u, q)
    assert torch.equal(y, silu_mul_triton(g, u))
    check(y, q, pow2)
print("OK")
"""


def test_producer_quantization_is_the_quantizers_in_interpreter(interpreted):
    """The norms and SwiGLU writing their FP8 consumer's input (jetrl/fp8/producer_quant.py): output unchanged,
    codes and scales bit-equal to the quantizer's."""
    check_ran("producer_quant", interpreted["producer_quant"])


def test_fused_path_is_cuda_only_and_on_by_default(monkeypatch):
    x = torch.randn(2, 8)
    with use_fused_ops(True):
        assert not fused_ops_enabled(x)  # CPU always runs the reference
    monkeypatch.delenv("JETRL_FUSED_OPS", raising=False)
    assert fused_ops_requested()
    monkeypatch.setenv("JETRL_FUSED_OPS", "0")
    assert not fused_ops_requested()
    with use_fused_ops(True):
        assert fused_ops_requested()
    monkeypatch.setenv("JETRL_FUSED_OPS", "yes")
    with pytest.raises(ValueError, match="JETRL_FUSED_OPS='yes'"):
        fused_ops_enabled(x)


def test_references_are_the_model_math():
    x, w = torch.randn(3, 64), torch.randn(64)
    xf = x.float()
    expected = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)
    assert torch.equal(rms_norm_reference(x, w, 1e-5), expected)
    q, cos, sin = torch.randn(1, 2, 3, 8), torch.randn(1, 3, 8), torch.randn(1, 3, 8)
    rotated = torch.cat((-q[..., 4:], q[..., :4]), dim=-1)
    assert torch.equal(apply_rope_reference(q, cos, sin), q * cos[:, None] + rotated * sin[:, None])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_kernels_on_cuda_and_in_the_model():
    from jetrl.models import CausalLM, ModelConfig
    from jetrl.models.llama import RMSNorm

    torch.manual_seed(0)
    q = torch.randn(4, 9, 8, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    ang = torch.randn(4, 9, 64, device="cuda").repeat(1, 1, 2)
    cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
    x, w = torch.randn(37, 4096, device="cuda", dtype=torch.bfloat16), torch.randn(4096, device="cuda").bfloat16()
    ref_norm, ref_rope = rms_norm_reference(x, w, 1e-6), apply_rope_reference(q, cos, sin)
    with use_fused_ops(True):
        from jetrl.models.fused import apply_rope, rms_norm, silu_mul, silu_mul_reference

        assert torch.equal(apply_rope(q, cos, sin), ref_rope)
        g, u = x * 3, x.flip(0)
        assert torch.equal(silu_mul(g, u), silu_mul_reference(g, u))
        assert float(((rms_norm(x, w, 1e-6).float() - ref_norm.float()).abs() / ref_norm.float().abs().clamp_min(1e-3)).max()) <= 2**-7
        from jetrl.models.fused import add_rms_norm, norm_rope

        h, y = add_rms_norm(x, x.flip(0), w, 1e-6)
        ref_y = rms_norm_reference(x + x.flip(0), w, 1e-6)
        assert torch.equal(h, x + x.flip(0))
        assert float((y.float() - ref_y.float()).abs().max()) <= 2 * 2**-7 * float(ref_y.float().abs().max())
        qkv = torch.randn(4, 9, 12 * 128, device="cuda", dtype=torch.bfloat16)  # 8 q heads, 2 k, 2 v
        qn, kn = RMSNorm(128, 1e-6).cuda().bfloat16(), RMSNorm(128, 1e-6).cuda().bfloat16()
        with torch.no_grad():
            qn.weight.normal_(1, 0.1), kn.weight.normal_(1, 0.1)
            q, k = qkv[..., :1024].view(4, 9, 8, 128), qkv[..., 1024:1280].view(4, 9, 2, 128)
            for got, x_, n in zip(norm_rope(q, k, cos, sin, qn, kn), (q, k), (qn, kn)):
                ref = apply_rope_reference(rms_norm_reference(x_, n.weight, 1e-6).transpose(1, 2), cos, sin)
                assert float((got.float() - ref.float()).abs().max()) <= 4 * 2**-7 * float(ref.float().abs().max())
    cfg = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, qk_norm=True, architecture="Qwen3ForCausalLM")
    model = CausalLM(cfg).to("cuda", torch.bfloat16)
    ids = torch.randint(0, 512, (3, 17), device="cuda")
    with use_fused_ops(False):
        plain = model(ids)  # the PyTorch references
    with use_fused_ops(True):
        fused = model(ids)
        fused.float().pow(2).mean().backward()  # the autograd wrappers run in training
    assert float((fused.float() - plain.float()).norm() / plain.float().norm()) < 2e-2
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
