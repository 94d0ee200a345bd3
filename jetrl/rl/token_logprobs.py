"""The logprob of each chosen token under the model's logits, and the entropy of each distribution.

    lp[r] = log_softmax(logits[r] / T)[tokens[r]],     entropy[r] = -sum_v p[r, v] log p[r, v]

the numbers GRPO's ratio and every mismatch metric are built from (batch.completion_logprobs).
:func:`token_logprobs_reference` is the spec: fp32 PyTorch ops, the CPU path, and the GPU path with
``JETRL_FUSED_OPS=0``. On CUDA with Triton, :func:`token_logprobs` runs the streaming kernels of
:mod:`jetrl.rl.kernels.token_logprobs_triton` instead (forward and gradient), which never build the
(rows, V) fp32 tensors: at V = 151936 each of those is ~5 GB per training micro-batch. The entropy is
a metric: it carries no gradient on either path.
"""

from __future__ import annotations

import torch
from torch import Tensor


def token_logprobs_reference(logits: Tensor, tokens: Tensor, temperature: float = 1.0,
                             with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """(lp, entropy or None), each shaped like ``tokens``, fp32; logits (..., V), tokens (...) integer."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    lp = log_probs.gather(-1, tokens[..., None].long()).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            # 0 log 0 = 0: a logit of -inf (a masked word) adds nothing instead of NaN
            entropy = -torch.where(log_probs == float("-inf"), 0.0, log_probs.exp() * log_probs).sum(-1)
    return lp, entropy


def token_logprobs(logits: Tensor, tokens: Tensor, temperature: float = 1.0,
                   with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """:func:`token_logprobs_reference`'s result; the fused kernels on CUDA (module docstring)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for logprobs, got {temperature}")
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(f"logits {tuple(logits.shape)} need one token per row, got tokens {tuple(tokens.shape)}")
    if tokens.is_floating_point() or tokens.device != logits.device:
        raise ValueError(f"tokens must be an integer tensor on the logits' device ({logits.device}), "
                         f"got {tokens.dtype} on {tokens.device}")
    if tokens.numel():
        low, high = (int(v) for v in torch.aminmax(tokens))  # one host sync; a bad id never reaches a kernel
        if low < 0 or high >= logits.shape[-1]:
            raise ValueError(f"token ids must lie in [0, {logits.shape[-1]}) (the logits' vocabulary), "
                             f"got ids from {low} to {high}")
    return _token_logprobs(logits, tokens, temperature, with_entropy)


def chosen_token_logprobs(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """:func:`token_logprobs`'s logprobs by the very same kernels, minus its checks (no host sync, so a CUDA
    graph may hold it): how the engine reports a sampled token's logprob in exact mode (jetrl/exact.py) and
    how ``Engine.score`` scores one -- the trainer's own arithmetic, row by row."""
    return _token_logprobs(logits, tokens, float(temperature), False)[0]


def _token_logprobs(logits: Tensor, tokens: Tensor, temperature: float,
                    with_entropy: bool) -> tuple[Tensor, Tensor | None]:
    from jetrl.models.fused import fused_ops_enabled

    if not fused_ops_enabled(logits):
        return token_logprobs_reference(logits, tokens, temperature, with_entropy)
    rows = logits.reshape(-1, logits.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    flat = tokens.reshape(-1).to(torch.int64).contiguous()
    lp, entropy = _TokenLogprobs.apply(rows, flat, float(temperature), with_entropy)
    return lp.view(tokens.shape), (entropy.view(tokens.shape) if with_entropy else None)


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tokens, temperature, with_entropy):
        from jetrl.rl.kernels.token_logprobs_triton import token_logprobs_forward

        lp, entropy, m, log_s = token_logprobs_forward(logits, tokens, temperature, with_entropy)
        ctx.save_for_backward(logits, tokens, m, log_s)
        ctx.temperature = temperature
        if entropy is None:
            entropy = lp.new_empty(0)
        ctx.mark_non_differentiable(entropy)
        return lp, entropy

    @staticmethod
    def backward(ctx, grad_lp, _grad_entropy):
        from jetrl.rl.kernels.token_logprobs_triton import token_logprobs_backward

        logits, tokens, m, log_s = ctx.saved_tensors
        grad = token_logprobs_backward(logits, tokens, grad_lp, m, log_s, ctx.temperature)
        return grad, None, None, None
