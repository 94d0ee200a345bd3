"""Triton kernels of model ops (fused RMSNorm, fused RoPE). Each has a PyTorch reference in
:mod:`jetrl.models.fused` that is its spec. Triton is imported lazily, by the kernel module
about to run: jetrl imports and runs without it (the references take over;
``jetrl.fp8.kernels.has_triton`` tells).
"""
