"""The fused q/k-norm + RoPE and residual-add + RMSNorm kernels against the kernels they replace, on the GPU,
at the training shape of ``jetrl bench`` (f) (8 x 1152 tokens of an 8B-shaped Qwen3) and the decode shape
of (d) (256 tokens): forward alone (no autograd) and forward + backward through the autograd wrappers.
GPU only.

    PYTHONPATH=. python3 bench/time_fused_forward.py
"""

import torch
from triton.testing import do_bench

from jetrl.models.fused import _FusedNormRoPE, _FusedRMSNorm, _FusedRoPE, add_rms_norm, use_fused_ops
from jetrl.models.kernels.fused_triton import add_rms_norm_triton, apply_rope_triton, norm_rope_triton, rms_norm_triton


def rand(*shape, grad=False):
    return (torch.randn(*shape, device="cuda") * 0.5).bfloat16().requires_grad_(grad)


def main() -> None:
    for batch, seq in ((8, 1152), (256, 1)):
        tokens = batch * seq
        qkv = rand(batch, seq, 48 * 128)
        q, k = qkv[..., :4096].view(batch, seq, 32, 128), qkv[..., 4096:5120].view(batch, seq, 8, 128)
        qw, kw = 1 + rand(128) * 0.1, 1 + rand(128) * 0.1
        ang = torch.randn(batch, seq, 64, device="cuda").repeat(1, 1, 2)
        cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
        x, d, w = rand(tokens, 4096), rand(tokens, 4096), 1 + rand(4096) * 0.1

        def separate():
            qn, kn = rms_norm_triton(q, qw, 1e-6), rms_norm_triton(k, kw, 1e-6)
            return apply_rope_triton(qn.transpose(1, 2), cos, sin), apply_rope_triton(kn.transpose(1, 2), cos, sin)

        def add_then_norm():
            h = x + d
            return h, rms_norm_triton(h, w, 1e-6)

        print(f"{tokens} tokens, forward: q/k norm + RoPE separate {do_bench(separate) * 1e3:.1f} us, "
              f"fused {do_bench(lambda: norm_rope_triton(q, k, qw, kw, 1e-6, cos, sin)) * 1e3:.1f} us; "
              f"add + RMSNorm separate {do_bench(add_then_norm) * 1e3:.1f} us, "
              f"fused {do_bench(lambda: add_rms_norm_triton(x, d, w, 1e-6)) * 1e3:.1f} us", flush=True)
        if seq == 1:
            continue
        qg, kg = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
        qwg, kwg = qw.detach().clone().requires_grad_(), kw.detach().clone().requires_grad_()
        xg, dg, wg = (t.detach().clone().requires_grad_() for t in (x, d, w))
        gq, gk, gx = torch.randn_like(q).transpose(1, 2), torch.randn_like(k).transpose(1, 2), torch.randn_like(x)

        def separate_bwd():
            qo = _FusedRoPE.apply(_FusedRMSNorm.apply(qg, qwg, 1e-6).transpose(1, 2), cos, sin)
            ko = _FusedRoPE.apply(_FusedRMSNorm.apply(kg, kwg, 1e-6).transpose(1, 2), cos, sin)
            torch.autograd.backward((qo, ko), (gq, gk))

        def fused_bwd():
            torch.autograd.backward(_FusedNormRoPE.apply(qg, kg, qwg, kwg, 1e-6, cos, sin), (gq, gk))

        def add_norm_bwd(fused: bool):
            with use_fused_ops(True):
                if fused:
                    h, y = add_rms_norm(xg, dg, wg, 1e-6)
                else:
                    h = xg + dg
                    y = _FusedRMSNorm.apply(h, wg, 1e-6)
                torch.autograd.backward((h, y), (gx, gx))

        print(f"{tokens} tokens, forward + backward: q/k norm + RoPE separate {do_bench(separate_bwd) * 1e3:.1f} us, "
              f"fused {do_bench(fused_bwd) * 1e3:.1f} us; add + RMSNorm separate "
              f"{do_bench(lambda: add_norm_bwd(False)) * 1e3:.1f} us, "
              f"fused {do_bench(lambda: add_norm_bwd(True)) * 1e3:.1f} us",
              flush=True)


if __name__ == "__main__":
    main()
