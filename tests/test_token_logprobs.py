"""Chosen-token logprobs and entropies (jetrl/rl/token_logprobs.py): the streaming Triton kernels against
the fp32 PyTorch reference -- under ``TRITON_INTERPRET=1`` on CPU and on the GPU -- and the dispatch.

Checked: lp and entropy within 2e-5 of the reference (fp32 sums in another order), bf16 and fp32
logits, T = 1 and T = 0.7, vocabularies that are and are not a multiple of the kernel's tile, rows
with -inf logits; the gradient wrt the logits against autograd through the reference, in the logits'
dtype; a token outside the vocabulary gives NaN (no stray read); on CPU the public function is the
reference bit for bit; bad arguments raise actionable errors.
"""

import os
import subprocess
import sys

import pytest
import torch

from jetrl.rl.token_logprobs import token_logprobs, token_logprobs_reference

SCRIPT = r"""
import torch
from jetrl.rl.kernels.token_logprobs_triton import token_logprobs_backward, token_logprobs_forward
from jetrl.rl.token_logprobs import token_logprobs_reference

torch.manual_seed(0)
checked = 0
for dtype in (torch.bfloat16, torch.float32):
    for n, v in ((5, 1000), (3, 8192), (2, 9001)):
        for temperature in (1.0, 0.7):
            x = (torch.randn(n, v) * 3).to(dtype)
            x[0, 7:50] = float("-inf")  # masked logits: probability 0
            tokens = torch.randint(0, v, (n,))
            tokens[0] = 3
            lp, ent, m, log_s = token_logprobs_forward(x, tokens, temperature, True)
            ref_lp, ref_ent = token_logprobs_reference(x, tokens, temperature, True)
            assert torch.allclose(lp, ref_lp, rtol=2e-5, atol=2e-5), (dtype, n, v, temperature, (lp - ref_lp).abs().max())
            assert torch.allclose(ent, ref_ent, rtol=2e-5, atol=2e-5), (dtype, n, v, temperature, (ent - ref_ent).abs().max())
            lp2, none, _, _ = token_logprobs_forward(x, tokens, temperature, False)
            assert none is None and torch.equal(lp2, lp)
            g = torch.randn(n)
            grad = token_logprobs_backward(x, tokens, g, m, log_s, temperature)
            leaf = x.detach().requires_grad_()
            (ref_grad,) = torch.autograd.grad(token_logprobs_reference(leaf, tokens, temperature)[0], leaf, g)
            assert grad.dtype == x.dtype
            ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 1e-5
            err = float((grad.float() - ref_grad.float()).abs().max())
            assert err <= 2 * ulp * float(ref_grad.float().abs().max()) + 1e-7, (dtype, n, v, temperature, err)
            checked += 1
lp, _, _, _ = token_logprobs_forward(torch.randn(2, 300), torch.tensor([5, 300]), 1.0, False)
assert torch.isfinite(lp[0]) and torch.isnan(lp[1])  # token 300 of a 300-word vocabulary
print("OK", checked)
"""


def test_kernels_match_the_reference_in_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], check=False, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and proc.stdout.startswith("OK 12"), proc.stdout + proc.stderr[-3000:]


def test_cpu_runs_the_reference_bit_for_bit():
    logits = torch.randn(2, 3, 50, requires_grad=True)
    tokens = torch.randint(0, 50, (2, 3))
    lp, ent = token_logprobs(logits, tokens, 0.9, with_entropy=True)
    ref_lp, ref_ent = token_logprobs_reference(logits, tokens, 0.9, with_entropy=True)
    assert torch.equal(lp, ref_lp) and torch.equal(ent, ref_ent) and not ent.requires_grad
    lp.sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    assert token_logprobs(logits, tokens)[1] is None


def test_bad_arguments_raise_actionable_errors():
    with pytest.raises(ValueError, match="temperature must be > 0"):
        token_logprobs(torch.randn(2, 5), torch.zeros(2, dtype=torch.int64), 0.0)
    with pytest.raises(ValueError, match="one token per row"):
        token_logprobs(torch.randn(2, 5), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="integer tensor"):
        token_logprobs(torch.randn(2, 5), torch.zeros(2))
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 5\).*from 0 to 5"):
        token_logprobs(torch.randn(2, 5), torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="from -1 to 2"):
        token_logprobs(torch.randn(2, 5), torch.tensor([-1, 2]))
    logits, tokens = torch.randn(2, 5), torch.tensor([1, 4], dtype=torch.int32)  # int32 ids work too
    assert torch.equal(token_logprobs(logits, tokens)[0], torch.log_softmax(logits, -1)[[0, 1], [1, 4]])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_path_on_cuda_matches_the_reference():
    pytest.importorskip("triton")
    from jetrl.models.fused import use_fused_ops

    torch.manual_seed(0)
    for temperature in (1.0, 0.7):
        logits = (torch.randn(4, 300, 151936, device="cuda") * 3).bfloat16().requires_grad_()
        tokens = torch.randint(0, 151936, (4, 300), device="cuda")
        g = torch.randn(4, 300, device="cuda")
        with use_fused_ops(True):
            lp, ent = token_logprobs(logits, tokens, temperature, with_entropy=True)
            (grad,) = torch.autograd.grad(lp, logits, g)
        ref_lp, ref_ent = token_logprobs_reference(logits, tokens, temperature, with_entropy=True)
        (ref_grad,) = torch.autograd.grad(ref_lp, logits, g)
        torch.testing.assert_close(lp, ref_lp, rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(ent, ref_ent, rtol=2e-5, atol=2e-5)
        assert grad.dtype == torch.bfloat16
        assert float((grad.float() - ref_grad.float()).abs().max()) <= 2 * 2**-7 * float(ref_grad.float().abs().max())
