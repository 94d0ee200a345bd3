"""Fused backward kernels of RMSNorm / RoPE / SwiGLU against autograd through their references.

The kernels run on CPU under ``TRITON_INTERPRET=1`` (one subprocess per op, side by side)
and on the GPU at a training update's sizes. Tolerances, elementwise:

    |got - ref| <= k * ulp_dtype(ref) + c * 2^-24 * scale

``ulp_dtype(ref)`` is the spacing of the output dtype at ``ref`` (k = 1: one final rounding that may
land on the other side of a tie; k = 2 for SwiGLU's grad_up, whose rounded silu(g) may itself flip);
``scale`` bounds the fp32 intermediates (e.g. ``r * (|g| + |n| * mean|g n|)`` for RMSNorm's
grad_x), so ``c * 2^-24 * scale`` allows a few fp32 roundings where the kernel's order differs
from autograd's (observed c <= 5 for RMSNorm, <= 9 for SwiGLU on CPU). grad_w's sum over rows adds
``ulp_x * sum|grad_y * n|``: a recomputed r may flip round_x(n) by one ulp in any row. RoPE has no
reduction and no reordering: bit for bit. The fp32 sanity check (as gradcheck would, without fp64):
the autograd Functions match autograd of the reference within 1e-5 of the gradient's norm.
"""


import pytest
import torch

from .conftest import compile_for_sm90
from .subprocesses import check_ran, interpret

HEADER = r"""
import torch
from jetrl.models.fused import (_FusedAddRMSNorm, _FusedRMSNorm, _FusedRoPE, _FusedSiluMul, _reference_grads,
                                apply_rope_reference, rms_norm_reference, silu_mul_reference)
from jetrl.models.kernels.fused_backward_triton import rms_norm_backward_triton, silu_mul_backward_triton
from jetrl.models.kernels.fused_triton import apply_rope_backward_triton

MANTISSA = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}
EPS32 = 2.0 ** -24  # fp32's unit roundoff

def check(name, got, ref, ulps, slack):
    # |got - ref| <= ulps * ulp(ref) in ref's dtype + slack, elementwise
    assert got.dtype == ref.dtype and got.shape == ref.shape, (name, got.dtype, ref.dtype, got.shape, ref.shape)
    ref64, err = ref.double(), (got.double() - ref.double()).abs()
    ulp = torch.exp2(torch.floor(torch.log2(ref64.abs())) - MANTISSA[ref.dtype]).nan_to_num(0.0, 0.0, 0.0)
    bound = ulps * ulp + slack
    assert bool((err <= bound).all()), (name, float((err - bound).max()), float(err.max()))

def fp32_close(name, got, ref):
    assert float((got - ref).norm() / ref.norm()) <= 1e-5, (name, float((got - ref).norm() / ref.norm()))

torch.manual_seed(0)
"""

RMS_NORM = r"""
def norm_case(x, w, gy, eps=1e-6):
    gx, gw = rms_norm_backward_triton(x, w, eps, gy)
    rx, rw = _reference_grads(lambda a, b: rms_norm_reference(a, b, eps), (x, w), gy, (True, True))
    xf = x.double()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    n, g = xf * r, gy.double() * w.double()
    check("grad_x", gx, rx, 1, 8 * EPS32 * r * (g.abs() + n.abs() * (g * n).abs().mean(-1, keepdim=True)))
    terms = (gy.double() * n).abs().reshape(-1, x.shape[-1]).sum(0)  # sum over rows of |grad_y * n|
    check("grad_w", gw, rw, 1, (8 * EPS32 + 2.0 ** -MANTISSA[x.dtype]) * terms)
    return gx, gw

for dtype, wdtype in [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                      (torch.float16, torch.float16)]:
    # odd row counts, D not a power of two, 2-D to 4-D; (300, 256) makes each program loop over row blocks
    for shape in [(7, 5, 128), (33, 576), (3, 2, 3, 64), (5, 1000), (300, 256), (3, 4096), (2, 8192)]:
        x = (torch.randn(shape) * 3).to(dtype)
        w = (1 + 0.1 * torch.randn(shape[-1])).to(wdtype)
        gy = torch.randn(shape).to(torch.promote_types(dtype, wdtype))
        gx, gw = norm_case(x, w, gy)
        # grad_x is per row: a row alone gives the same bits as inside the batch
        x2, gy2 = x.reshape(-1, shape[-1]), gy.reshape(-1, shape[-1])
        assert torch.equal(rms_norm_backward_triton(x2[2:3], w, 1e-6, gy2[2:3])[0], gx.reshape(-1, shape[-1])[2:3])
# strided rows: q as a column slice of a q|k|v buffer, its gradient a transposed (attention-side) view
buf = torch.randn(5, 3, 6 * 64).to(torch.bfloat16)
x = buf[..., 64:320].view(5, 3, 4, 64)
w = (1 + 0.1 * torch.randn(64)).to(torch.bfloat16)
gy = torch.randn(5, 4, 3, 64).to(torch.bfloat16).transpose(1, 2)
gx, gw = norm_case(x, w, gy)
assert gx.is_contiguous()
assert all(torch.equal(a, b) for a, b in zip((gx, gw), rms_norm_backward_triton(x.contiguous(), w, 1e-6, gy.contiguous())))
empty = torch.zeros(0, 3, 64, dtype=torch.bfloat16)
gx, gw = rms_norm_backward_triton(empty, w, 1e-6, empty)
assert gx.shape == (0, 3, 64) and torch.equal(gw, torch.zeros_like(w))  # no rows: grad_w is zeros
# the autograd Function: weight without grad skips grad_w; fp32 matches autograd of the reference
x = torch.randn(9, 2, 96, requires_grad=True)
w = (1 + 0.1 * torch.randn(96)).requires_grad_()
gy = torch.randn(9, 2, 96)
got = torch.autograd.grad(_FusedRMSNorm.apply(x, w, 1e-5), (x, w), gy)
ref = torch.autograd.grad(rms_norm_reference(x, w, 1e-5), (x, w), gy)
for name, a, b in zip(("grad_x", "grad_w"), got, ref):
    fp32_close(name, a, b)
(gx_only,) = torch.autograd.grad(_FusedRMSNorm.apply(x, w.detach(), 1e-5), (x,), gy)
assert torch.equal(gx_only, got[0])
# a residual gradient added in the kernel: grad_x + residual_grad bit for bit (a strided residual too)
for dtype in (torch.bfloat16, torch.float32):
    x, gy = (torch.randn(6, 5, 256) * 3).to(dtype), torch.randn(6, 5, 256).to(dtype)
    w = (1 + 0.1 * torch.randn(256)).to(dtype)
    gr = torch.randn(5, 6, 256).to(dtype).transpose(0, 1)
    gx, gw = rms_norm_backward_triton(x, w, 1e-6, gy)
    gx_res, gw_res = rms_norm_backward_triton(x, w, 1e-6, gy, residual_grad=gr)
    assert torch.equal(gx_res, gx + gr) and torch.equal(gw_res, gw), dtype
# add + RMSNorm's Function: grad_x = grad_delta = grad_h + the norm's grad, as autograd of the two ops sums them
xa = torch.randn(4, 3, 128).to(torch.bfloat16).requires_grad_()
da = torch.randn(4, 3, 128).to(torch.bfloat16).requires_grad_()
wa = (1 + 0.1 * torch.randn(128)).to(torch.bfloat16).requires_grad_()
h, y = _FusedAddRMSNorm.apply(xa, da, wa, 1e-6)
gh, gy = torch.randn(4, 3, 128).to(torch.bfloat16), torch.randn(4, 3, 128).to(torch.bfloat16)
got = torch.autograd.grad((h, y), (xa, da, wa), (gh, gy))
gx_norm, gw_norm = rms_norm_backward_triton(h.detach(), wa.detach(), 1e-6, gy)
assert torch.equal(got[0], gh + gx_norm) and torch.equal(got[1], got[0]) and torch.equal(got[2], gw_norm)
(gd_only,) = torch.autograd.grad(_FusedAddRMSNorm.apply(xa.detach(), da, wa.detach(), 1e-6), (da,), (gh, gy))
assert torch.equal(gd_only, got[1])
(gw_only,) = torch.autograd.grad(_FusedAddRMSNorm.apply(xa.detach(), da.detach(), wa, 1e-6)[1], (wa,), gy)
assert torch.equal(gw_only, got[2])
print("OK")
"""

ROPE = r"""
for dtype in (torch.bfloat16, torch.float32, torch.float16):
    for B, H, T, D, cos_batch in [(2, 4, 5, 64, 2), (3, 2, 1, 128, 3), (2, 3, 7, 32, 1)]:
        x = torch.randn(B, T, H, D).to(dtype).transpose(1, 2)  # the model's strided (B, H, T, D) view
        gy = torch.randn(B, H, T, D).to(dtype)
        # general tables: sin's two halves differ, so a kernel assuming HF's duplicated halves would fail
        cos, sin = torch.randn(cos_batch, T, D).to(dtype), torch.randn(cos_batch, T, D).to(dtype)
        (ref,) = _reference_grads(lambda a: apply_rope_reference(a, cos, sin), (x,), gy, (True,))
        assert torch.equal(apply_rope_backward_triton(gy, cos, sin), ref), (dtype, B, H, T, D)
        assert torch.equal(apply_rope_backward_triton(gy.transpose(1, 2).contiguous().transpose(1, 2), cos, sin), ref)
q = torch.randn(2, 3, 4, 64, requires_grad=True)
ang = torch.randn(2, 4, 32).repeat(1, 1, 2)
gq = torch.randn(2, 3, 4, 64)
(got,) = torch.autograd.grad(_FusedRoPE.apply(q, ang.cos(), ang.sin()), (q,), gq)
(ref,) = torch.autograd.grad(apply_rope_reference(q, ang.cos(), ang.sin()), (q,), gq)
assert torch.equal(got, ref)
print("OK")
"""

SILU_MUL = r"""
def silu_case(g, u, gy):
    gg, gu = silu_mul_backward_triton(g, u, gy)
    rg, ru = _reference_grads(silu_mul_reference, (g, u), gy, (True, True))
    sig = torch.sigmoid(g.double())
    check("grad_gate", gg, rg, 1, 16 * EPS32 * (gy.double() * u.double()).abs() * sig * (1 + g.double().abs() * (1 - sig)))
    check("grad_up", gu, ru, 2, 16 * EPS32 * (gy.double() * g.double() * sig).abs())

for dtype in (torch.bfloat16, torch.float32, torch.float16):
    for shape in [(3, 5, 1000), (7, 2304), (1, 96)]:
        g, u = (torch.randn(shape) * 4).to(dtype), torch.randn(shape).to(dtype)
        silu_case(g, u, torch.randn(shape).to(dtype))
# strided rows: gate and up as column slices of one gate|up buffer
gu = (torch.randn(5, 2, 600) * 3).to(torch.bfloat16)
silu_case(gu[..., :300], gu[..., 300:], torch.randn(5, 2, 300).to(torch.bfloat16))
g, u = torch.randn(6, 300, requires_grad=True), torch.randn(6, 300, requires_grad=True)
gy = torch.randn(6, 300)
got = torch.autograd.grad(_FusedSiluMul.apply(g, u), (g, u), gy)
ref = torch.autograd.grad(silu_mul_reference(g, u), (g, u), gy)
for name, a, b in zip(("grad_gate", "grad_up"), got, ref):
    fp32_close(name, a, b)
(gu_only,) = torch.autograd.grad(_FusedSiluMul.apply(g.detach(), u), (u,), gy)
assert torch.equal(gu_only, got[1])
print("OK")
"""


@pytest.fixture(scope="module")
def interpreted():
    """The three scripts, run side by side once (tests/subprocesses.py); each test checks its own."""
    pytest.importorskip("triton")
    return interpret({"rms_norm": HEADER + RMS_NORM, "rope": HEADER + ROPE, "silu_mul": HEADER + SILU_MUL})


@pytest.mark.parametrize("name", ["rms_norm", "rope", "silu_mul"])
def test_backward_kernels_match_reference_autograd_in_interpreter(interpreted, name):
    check_ran(name, interpreted[name])


def test_backward_kernels_compile_for_hopper():
    """The interpreter runs the EMULATE branches; this compiles the GPU paths for sm_90, no GPU needed."""
    pytest.importorskip("triton")
    import triton.language as tl

    from jetrl.models.kernels import fused_backward_triton, fused_triton

    bf16 = {"X_DTYPE": tl.bfloat16, "Y_DTYPE": tl.bfloat16, "HAS_GW": True, "EMULATE": False}
    for block_r, block_c, has_res in ((1, 8192, False), (16, 128, True), (8, 4096, True)):
        norm = compile_for_sm90(fused_backward_triton._rms_norm_bwd_kernel,
                                {"BLOCK_R": block_r, "BLOCK_C": block_c, "ITERS": 4, "HAS_RES": has_res, **bf16},
                                {"x_ptr": "*bf16", "w_ptr": "*bf16", "gy_ptr": "*bf16", "gr_ptr": "*bf16",
                                 "gx_ptr": "*bf16"},
                                floats=("eps",), num_warps=16 if block_c > 4096 else 8)
        assert norm.asm["cubin"]
    silu = compile_for_sm90(fused_backward_triton._silu_mul_bwd_kernel,
                            {"BLOCK": 1024, "DTYPE": tl.bfloat16, "EMULATE": False},
                            {name: "*bf16" for name in ("g_ptr", "u_ptr", "gy_ptr", "gg_ptr", "gu_ptr")})
    rope = compile_for_sm90(fused_triton._rope_kernel,
                            {"HALF": 64, "BLOCK_R": 16, "DTYPE": tl.bfloat16, "BACKWARD": True, "EMULATE": False},
                            {name: "*bf16" for name in ("x_ptr", "cos_ptr", "sin_ptr", "out_ptr")})
    assert silu.asm["cubin"] and rope.asm["cubin"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_backward_kernels_on_cuda_at_training_sizes():
    """One micro-batch of the 8B-shaped profile: 9216 tokens, hidden 4096, 32/8 heads of 128, MLP 12288."""
    from jetrl.models.fused import _reference_grads, apply_rope_reference, rms_norm_reference, silu_mul_reference
    from jetrl.models.kernels.fused_backward_triton import rms_norm_backward_triton, silu_mul_backward_triton
    from jetrl.models.kernels.fused_triton import apply_rope_backward_triton

    def ulp_close(got, ref, ulps=1, atol=0.0):
        ulp = torch.exp2(torch.floor(torch.log2(ref.float().abs())) - 7).nan_to_num(0.0, 0.0, 0.0)
        err = (got.float() - ref.float()).abs()
        return bool((err <= ulps * ulp + atol).all()), float(err.max())

    torch.manual_seed(0)
    dev, bf16, tokens = "cuda", torch.bfloat16, 9216
    for shape in [(tokens, 4096), (tokens, 32, 128), (tokens, 8, 128), (tokens // 2, 8192)]:
        x = (torch.randn(shape, device=dev) * 3).to(bf16)
        w = (1 + 0.1 * torch.randn(shape[-1], device=dev)).to(bf16)
        gy = torch.randn(shape, device=dev).to(bf16)
        gx, gw = rms_norm_backward_triton(x, w, 1e-6, gy)
        rx, rw = _reference_grads(lambda a, b: rms_norm_reference(a, b, 1e-6), (x, w), gy, (True, True))
        scale = float(rx.float().abs().max())
        ok, err = ulp_close(gx, rx, atol=2.0 ** -20 * scale)  # fp32 reordering: a few ulps of the row scale
        assert ok, (shape, "grad_x", err)
        terms = (gy.float() * x.float()).abs().reshape(-1, shape[-1]).sum(0)  # |x * r| ~ |x| / 3
        assert bool(((gw.float() - rw.float()).abs() <= 2.0 ** -7 * (rw.float().abs() + terms)).all()), shape
        assert torch.equal(rms_norm_backward_triton(x, w, 1e-6, gy)[1], gw)  # no atomics: run to run the same
        gr = torch.randn(shape, device=dev).to(bf16)  # add + RMSNorm's residual gradient, added in the kernel
        assert torch.equal(rms_norm_backward_triton(x, w, 1e-6, gy, residual_grad=gr)[0], gx + gr), shape
    for heads in (32, 8):
        cos, sin = torch.randn(8, 1152, 128, device=dev).to(bf16), torch.randn(8, 1152, 128, device=dev).to(bf16)
        gy = torch.randn(8, 1152, heads, 128, device=dev).to(bf16).transpose(1, 2)
        x = torch.zeros_like(gy)
        (ref,) = _reference_grads(lambda a, c=cos, s=sin: apply_rope_reference(a, c, s), (x,), gy, (True,))
        assert torch.equal(apply_rope_backward_triton(gy, cos, sin), ref), heads
    g, u = (torch.randn(tokens, 12288, device=dev) * 4).to(bf16), torch.randn(tokens, 12288, device=dev).to(bf16)
    gy = torch.randn(tokens, 12288, device=dev).to(bf16)
    gg, gu = silu_mul_backward_triton(g, u, gy)
    rg, ru = _reference_grads(silu_mul_reference, (g, u), gy, (True, True))
    ok, err = ulp_close(gg, rg, atol=2.0 ** -20 * float(rg.float().abs().max()))
    assert ok, ("grad_gate", err)
    ok, err = ulp_close(gu, ru, ulps=2)
    assert ok, ("grad_up", err)
