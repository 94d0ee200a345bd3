"""Fused RMSNorm / RoPE / SwiGLU kernels against their references (jetrl/models/fused.py).

On CPU the model always runs the references; the Triton kernels are checked here under
``TRITON_INTERPRET=1``: RoPE bit for bit (it has no reduction), RMSNorm within one ulp of the
model dtype (its row sum may be ordered differently) and batch-invariant, SwiGLU bit for bit in
bf16 (in fp32 within 4e-7 relative: the CPU reference's vectorized exp is not numpy's); the
autograd wrappers give the references' gradients (their backward kernels, one by one:
tests/test_fused_backward.py).
"""

import os
import subprocess
import sys

import pytest
import torch

from jetrl.models.fused import (
    apply_rope_reference,
    fused_ops_enabled,
    fused_ops_requested,
    rms_norm_reference,
    use_fused_ops,
)

SCRIPT = r"""
import torch
from jetrl.models.fused import (_FusedRMSNorm, _FusedRoPE, _FusedSiluMul, apply_rope_reference, rms_norm_reference,
                                silu_mul_reference)
from jetrl.models.kernels.fused_triton import apply_rope_triton, rms_norm_triton, silu_mul_triton

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
print("OK")
"""


def test_fused_kernels_match_references_in_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.startswith("OK"), proc.stdout + proc.stderr[-3000:]


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
    cfg = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, qk_norm=True, architecture="Qwen3ForCausalLM")
    model = CausalLM(cfg).to("cuda", torch.bfloat16)
    ids = torch.randint(0, 512, (3, 17), device="cuda")
    plain = model(ids)
    with use_fused_ops(True):
        fused = model(ids)
        fused.float().pow(2).mean().backward()  # the autograd wrappers run in training
    assert float((fused.float() - plain.float()).norm() / plain.float().norm()) < 2e-2
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
