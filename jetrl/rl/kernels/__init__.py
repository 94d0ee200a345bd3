"""Triton kernels of the RL side: the completion tokens' logprobs (``token_logprobs_triton``), whose
spec is :func:`jetrl.rl.token_logprobs.token_logprobs_reference`. Triton is imported lazily, by the
kernel module about to run: jetrl imports and runs without it (the reference takes over)."""
