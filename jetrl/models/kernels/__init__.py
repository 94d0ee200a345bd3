"""Triton kernels of model ops: fused RMSNorm, RoPE and SwiGLU (fused_triton.py) and their backward
(fused_backward_triton.py). Each has a PyTorch reference in :mod:`jetrl.models.fused` that is its
spec (for a backward: autograd through the reference). Triton is imported lazily, by the kernel module
about to run: jetrl imports and runs without it (the references take over;
``jetrl.fp8.kernels.has_triton`` tells).
"""
