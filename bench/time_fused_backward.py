"""Old vs new backward of RMSNorm, RoPE and SwiGLU on the GPU, at the training shapes of ``jetrl bench`` (f)
(9216 tokens per micro-batch of an 8B-shaped Qwen3). "old" is autograd through the fp32 PyTorch reference
(``_reference_grads``, the backward before the fused kernels); "new" the fused Triton kernels. The last row:
add + RMSNorm's backward with the residual stream's gradient added by PyTorch ("old") or in the kernel ("new").
GPU only.

    PYTHONPATH=. python3 bench/time_fused_backward.py
"""

import torch
from triton.testing import do_bench

from jetrl.models.fused import _reference_grads, apply_rope_reference, rms_norm_reference, silu_mul_reference
from jetrl.models.kernels.fused_backward_triton import rms_norm_backward_triton, silu_mul_backward_triton
from jetrl.models.kernels.fused_triton import apply_rope_backward_triton


def rand(*shape):
    return torch.randn(*shape, device="cuda").bfloat16()


def main() -> None:
    x, gy, w, gr = rand(9216, 4096), rand(9216, 4096), rand(4096), rand(9216, 4096)
    h, gh = rand(9216, 32, 128), rand(9216, 32, 128)
    q, cos, sin = rand(8, 1152, 32, 128).transpose(1, 2), rand(8, 1152, 128), rand(8, 1152, 128)
    gate, up, gs = rand(9216, 12288), rand(9216, 12288), rand(9216, 12288)
    norm = lambda a, v: rms_norm_reference(a, v, 1e-6)  # noqa: E731
    cases = [
        ("RMSNorm 9216x4096", lambda: _reference_grads(norm, (x, w), gy, (True, True)),
         lambda: rms_norm_backward_triton(x, w, 1e-6, gy)),
        ("q_norm 9216x32x128", lambda: _reference_grads(norm, (h, w[:128]), gh, (True, True)),
         lambda: rms_norm_backward_triton(h, w[:128], 1e-6, gh)),
        ("RoPE q 8x32x1152x128", lambda: _reference_grads(lambda a: apply_rope_reference(a, cos, sin), (q,), q, (True,)),
         lambda: apply_rope_backward_triton(q, cos, sin)),
        ("SwiGLU 9216x12288", lambda: _reference_grads(silu_mul_reference, (gate, up), gs, (True, True)),
         lambda: silu_mul_backward_triton(gate, up, gs)),
        ("add+RMSNorm 9216x4096, residual grad", lambda: rms_norm_backward_triton(x, w, 1e-6, gy)[0] + gr,
         lambda: rms_norm_backward_triton(x, w, 1e-6, gy, residual_grad=gr)),
    ]
    for name, old, new in cases:
        print(f"{name}: old {do_bench(old):.3f} ms, new {do_bench(new):.3f} ms", flush=True)


if __name__ == "__main__":
    main()
