"""Triton: the logprob (and entropy) of one chosen token per row of the logits, and its gradient, in
streaming passes over the logits in their own dtype.

Spec: :func:`jetrl.rl.token_logprobs.token_logprobs_reference` -- for a row x of V logits, its token c
and temperature T:

    z = x / T (fp32)      lp = log_softmax(z)[c] = (z_c - m) - log S,   m = max z,  S = sum_i exp(z_i - m)
    entropy = -sum_i p_i log p_i = log S - W / S,                        W = sum_i exp(z_i - m) (z_i - m)
    d lp / d x_i = (1[i = c] - p_i) / T,                                 p_i = exp((z_i - m) - log S)

Why: PyTorch materializes the (rows, V) logits in fp32, then log_softmax in fp32, then for the
entropy exp and a product of the same size -- at a training micro-batch of 8 x 1152 tokens and
V = 151936 that is ~5 GB per tensor and 19-30 ms of an H200 update (docs/benchmarks.md, (f)), plus
the same again in the backward. Here the forward reads the bf16 logits once, keeping m, S and W
online per row (S and W rescaled by exp(m_old - m_new) when the maximum grows, W also shifted by
(m_old - m_new) S_old); the backward reads them once more and writes the gradient in their dtype.
Each row is one program, so a row's results do not depend on the batch.

Numerics: fp32 throughout; the sums run in another order than PyTorch's, so lp and entropy agree
with the reference within ~1e-6 relative, not bit for bit (the CPU keeps the reference). z = x / T
is an IEEE division here (PyTorch's CUDA kernel multiplies by 1/T: within an ulp). Token ids are
checked by the caller (token_logprobs); one outside [0, V) still gives a NaN logprob here, never a
read outside the row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetrl.engine.kernels.sample_triton import online_logsumexp_step

BLOCK = 4096  # logits per tile


@triton.jit
def _z(row, idx, V, temperature, SCALE: tl.constexpr):
    x = tl.load(row + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
    if SCALE:
        x = tl.math.div_rn(x, temperature)
    return x


@triton.jit
def _forward_kernel(x_ptr, tok_ptr, lp_ptr, m_ptr, log_s_ptr, ent_ptr, V, stride_x, temperature,
                    BLOCK: tl.constexpr, SCALE: tl.constexpr, ENTROPY: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    row = x_ptr + r * stride_x
    offs = tl.arange(0, BLOCK)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    w = tl.zeros((), tl.float32)
    start = 0
    while start < V:  # a while loop: the interpreter's range() cannot take a runtime bound
        z = _z(row, start + offs, V, temperature, SCALE)
        m_new, m_safe, alpha, e, s_new = online_logsumexp_step(m, s, z, tl.max(z, axis=0))
        if ENTROPY:  # W relative to the new maximum: alpha (W + (m - m_new) S) + sum e (z - m_new)
            shift = tl.where(m == float("-inf"), 0.0, m - m_safe)
            w = alpha * (w + shift * s) + tl.sum(tl.where(e > 0, e * (z - m_safe), 0.0), axis=0)
        m, s = m_new, s_new
        start += BLOCK
    log_s = tl.log(s)
    tok = tl.load(tok_ptr + r)
    ok = (tok >= 0) & (tok < V)  # a token outside the vocabulary gives NaN, never a stray read
    z_tok = _z(row, tl.where(ok, tok, 0), V, temperature, SCALE)
    tl.store(lp_ptr + r, tl.where(ok, (z_tok - m) - log_s, float("nan")))
    tl.store(m_ptr + r, m)
    tl.store(log_s_ptr + r, log_s)
    if ENTROPY:
        tl.store(ent_ptr + r, log_s - w / s)


@triton.jit
def _backward_kernel(x_ptr, tok_ptr, g_ptr, m_ptr, log_s_ptr, gx_ptr, V, stride_x, stride_gx, temperature,
                     BLOCK: tl.constexpr, SCALE: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    row = x_ptr + r * stride_x
    out = gx_ptr + r * stride_gx
    offs = tl.arange(0, BLOCK)
    g = tl.load(g_ptr + r)
    m = tl.load(m_ptr + r)
    log_s = tl.load(log_s_ptr + r)
    tok = tl.load(tok_ptr + r)
    start = 0
    while start < V:
        idx = start + offs
        p = tl.exp((_z(row, idx, V, temperature, SCALE) - m) - log_s)
        grad = tl.where(idx == tok, g, 0.0) - p * g
        if SCALE:
            grad = tl.math.div_rn(grad, temperature)
        tl.store(out + idx, grad.to(gx_ptr.dtype.element_ty), mask=idx < V)
        start += BLOCK


def token_logprobs_forward(logits: torch.Tensor, tokens: torch.Tensor, temperature: float, with_entropy: bool
                           ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(lp, entropy or None, m, log S), each (N,) fp32, for logits (N, V) with unit column stride and tokens (N,)."""
    n, v = logits.shape
    assert logits.stride(1) == 1 and tokens.shape == (n,), (logits.stride(), tokens.shape)
    lp, m, log_s = (torch.empty(n, dtype=torch.float32, device=logits.device) for _ in range(3))
    entropy = torch.empty(n, dtype=torch.float32, device=logits.device) if with_entropy else None
    if n:
        _forward_kernel[(n,)](logits, tokens, lp, m, log_s, lp if entropy is None else entropy, v, logits.stride(0),
                              float(temperature), BLOCK=BLOCK, SCALE=temperature != 1.0, ENTROPY=with_entropy,
                              num_warps=8)
    return lp, entropy, m, log_s


def token_logprobs_backward(logits: torch.Tensor, tokens: torch.Tensor, grad: torch.Tensor, m: torch.Tensor,
                            log_s: torch.Tensor, temperature: float) -> torch.Tensor:
    """d (sum_r grad[r] lp[r]) / d logits, in the logits' dtype (module docstring)."""
    n, v = logits.shape
    grad_logits = torch.empty((n, v), dtype=logits.dtype, device=logits.device)
    if n:
        _backward_kernel[(n,)](logits, tokens, grad.contiguous(), m, log_s, grad_logits, v, logits.stride(0),
                               grad_logits.stride(0), float(temperature), BLOCK=BLOCK, SCALE=temperature != 1.0,
                               num_warps=8)
    return grad_logits
