"""Triton kernels against their PyTorch references, under TRITON_INTERPRET=1 on CPU.

The interpreter casts fp32 -> e4m3 through numpy, which rounds some elements differently
from torch's RNE cast (design.md §3); the kernel therefore rounds explicitly, and its codes
and scales must equal the reference's bit for bit, here and on the GPU (the bench checks).
"""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

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
print("OK")
"""


def test_quant_kernel_matches_reference_in_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.startswith("OK"), proc.stdout + proc.stderr[-3000:]
