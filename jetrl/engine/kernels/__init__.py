"""Triton kernels of the rollout engine. Each has a PyTorch reference with the same signature
that is its spec (``decode_attention_triton`` <- ``jetrl.engine.decode_attention.decode_attention_reference``,
``sample_triton`` <- ``jetrl.engine.sampling.sample_reference``, ``row_order_triton`` <- ``torch.argsort``).

Triton is imported lazily, only by the module of a kernel that is about to run: CPU wheels of
torch ship without it, and jetrl must import and run there (the references take over;
``jetrl.fp8.kernels.has_triton`` tells).
"""
