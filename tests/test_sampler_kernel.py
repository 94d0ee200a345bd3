"""The fused sampler (jetrl/engine/kernels/sample_triton.py) against its spec, ``sampling.sample_reference``.

CPU: the kernel runs under ``TRITON_INTERPRET=1`` (read by Triton at import, hence a subprocess):
one script, run as two processes side by side (each a share of the checks, ``CHECK_SHARES``), prints
one JSON line ``{check: "ok" | failure}``, and each test below asserts its entry. Skipped without Triton. Blocks of 256 logits, 2 per chunk, so V = 1000 has
2 chunks (the second ragged) and V = 4099 has 9 (the last 3 logits long).

Uniforms: the kernel computes ``counter_uniform`` itself, bit for bit (random and edge keys/steps).

Tokens. The kernel and the spec sum the cdf in fp32 in different orders (the CPU spec's cumsum
accumulates in double), so a draw whose target ``u * S`` lies within rounding of a cdf boundary can
take the neighbouring token: at V = 4099 about one draw in 3000 (measured on the GPU). Asserted:
tokens are equal, except draws within ``BOUNDARY_TOL`` of a boundary -- the exact cdf (fp64) at the
smaller of the two tokens is within it of u -- and those are at most ``MAX_BOUNDARY_FRACTION`` of
the draws (none in these 288 draws today). Greedy
tokens are equal, ties included. Logprobs: within 1e-5 absolute of the spec's at the kernel's token.
Frequencies: 320 draws from one 8-token row follow softmax(z / T) (chi-square, 7 dof, below the
0.1% critical value 24.3; deterministic keys, so not flaky).

GPU (skipped without CUDA): B = 256, V = 151936 bf16 logits, the engine's block sizes, against the
spec on the GPU, whose cdf is an fp32 parallel scan. With 152K boundaries a boundary draw is common:
measured on the H200, 107 of 8192 draws differ at T = 1 (all within 6e-7 of a boundary), and the spec
itself differs between GPU and CPU on 19 of 1024 draws; asserted: at most ``MAX_BOUNDARY_FRACTION_GPU``.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from jetrl.engine.sampling import (
    SamplingParams,
    counter_uniform,
    sample,
    sample_reference,
    use_fused_sampler,
    uses_fused_sampler,
)

from .conftest import compile_for_sm90, requires_cuda
from .subprocesses import run_interpreted

BOUNDARY_TOL = 1e-5  # |cdf64 - u| of a draw the kernel may resolve to the neighbouring token
MAX_BOUNDARY_FRACTION = 0.01  # CPU, V <= 4099
MAX_BOUNDARY_FRACTION_GPU = 0.03  # V = 151936: 107 of 8192 draws measured on the H200 (see the docstring)

# Shared by the interpreter script and the GPU test.
HELPERS = r"""
import torch

def mismatch_report(logits, params, keys, steps, tokens, ref_tokens):
    # (number of mismatches, largest |cdf64[min token] - u| among them): a mismatch must be a boundary draw
    bad = (tokens != ref_tokens).nonzero().flatten()
    if bad.numel() == 0:
        return 0, 0.0
    from jetrl.engine.sampling import counter_uniform
    z = logits[bad].double() / params.temperature
    cdf = torch.softmax(z, -1).cumsum(-1)
    first = torch.minimum(tokens[bad], ref_tokens[bad])
    u = counter_uniform(keys[bad], steps[bad]).double()
    return int(bad.numel()), float((cdf.gather(-1, first[:, None]).squeeze(-1) - u).abs().max())
"""

INTERPRETER_SCRIPT = HELPERS + r"""
import json, os, traceback
import torch
from jetrl.engine import Engine
from jetrl.engine.sampling import SamplingParams, counter_uniform, sample, sample_reference, use_fused_sampler
from jetrl.engine.kernels.sample_triton import sample_triton
from tests.engine_helpers import random_prompts, tiny_model

BLOCKS = {"block": 256, "tiles": 2}
TOL, MAX_FRACTION = float(os.environ["BOUNDARY_TOL"]), float(os.environ["MAX_BOUNDARY_FRACTION"])
results = {}

def check(fn):
    if fn.__name__ not in os.environ["CHECKS"].split(","):  # this process runs its share of the checks
        return fn
    try:
        fn()
        results[fn.__name__] = "ok"
    except Exception:
        results[fn.__name__] = traceback.format_exc(limit=4)[-1500:]
    return fn

def logits_rows(B, V, dtype, seed, width=None):
    # (B, V) rows of std 3, as a column slice of a wider buffer (row stride != V); row 1 half masked,
    # row 2 masked but for 3 logits
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, width or V, generator=g) * 3).to(dtype)[:, :V]
    x[1, : V // 2] = float("-inf")
    x[2, 3:] = float("-inf")
    return x

def draws(B, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2**32, (B,), generator=g), torch.randint(0, 10**6, (B,), generator=g)

@check
def uniforms_are_counter_uniform_bit_for_bit():
    from jetrl.engine.kernels.sample_triton import counter_uniform_triton
    g = torch.Generator().manual_seed(0)
    edges = torch.tensor([0, 1, 2**31, 2**32 - 1, 2**32, -1, 2**40 + 5, -(2**62)])
    keys = torch.cat([torch.randint(0, 2**32, (4000,), generator=g), edges, edges.flip(0)])
    steps = torch.cat([torch.randint(0, 2**20, (4000,), generator=g), edges.flip(0), edges])
    assert torch.equal(counter_uniform_triton(keys, steps), counter_uniform(keys, steps))

@check
def tokens_and_logprobs_match_spec():
    total = boundary = 0
    for V, dtype, T, B in [(1000, torch.float32, 1.0, 96), (4099, torch.bfloat16, 0.7, 48),
                           (1000, torch.bfloat16, 1.6, 96), (4099, torch.float16, 1.0, 48)]:
        x, (keys, steps) = logits_rows(B, V, dtype, seed=V + B, width=V + 37), draws(B, seed=B)
        params = SamplingParams(temperature=T)
        tokens, logprobs = sample_triton(x, params, keys, steps, **BLOCKS)
        ref_tokens, _ = sample_reference(x, params, keys, steps)
        n, dist = mismatch_report(x, params, keys, steps, tokens, ref_tokens)
        assert dist <= TOL, f"V={V} {dtype} T={T}: a token differs from the spec {dist:.2e} away from a boundary"
        total, boundary = total + B, boundary + n
        ref_lp = torch.log_softmax(x.float() / T, -1).gather(-1, tokens[:, None]).squeeze(-1)
        assert float((logprobs - ref_lp).abs().max()) <= 1e-5, (V, dtype, T, float((logprobs - ref_lp).abs().max()))
        assert bool((x[2, tokens[2]] > float("-inf"))) and int(tokens[1]) >= V // 2  # never a masked token
    assert boundary <= MAX_FRACTION * total, f"{boundary} of {total} draws differ from the spec"

@check
def greedy_matches_argmax_and_ties_take_the_first():
    for V, dtype in [(1000, torch.float32), (4099, torch.bfloat16)]:
        x = logits_rows(8, V, dtype, seed=V)
        x[3, [7, 300, 900]] = 50.0  # a tie inside one tile, and across tiles / chunks
        x[4, [600, V - 1]] = 50.0
        x[5] = 0.25  # every logit tied
        x[6] = float("-inf")  # all masked: token 0 (torch.argmax), logprob NaN (log_softmax)
        x[7] = float("-inf")
        x[7, V - 1] = 1.0
        keys = torch.zeros(8, dtype=torch.int64)
        tokens, logprobs = sample_triton(x, SamplingParams(temperature=0), keys, keys, **BLOCKS)
        ref_tokens, ref_logprobs = sample_reference(x, SamplingParams(temperature=0), keys, keys)
        assert torch.equal(tokens, ref_tokens), (tokens, ref_tokens)
        assert tokens[3] == 7 and tokens[4] == 600 and tokens[5] == 0 and tokens[6] == 0 and tokens[7] == V - 1
        torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-5, rtol=0, equal_nan=True)
        assert logprobs[6].isnan() and logprobs[7] == 0

@check
def one_finite_logit_is_drawn_with_logprob_zero():
    x = torch.full((3, 1000), float("-inf"))
    x[0, 0], x[1, 517], x[2, 999] = 2.0, -3.0, 40.0
    keys, steps = draws(3, seed=1)
    for T in (0, 1.0, 0.5):
        tokens, logprobs = sample_triton(x, SamplingParams(temperature=T), keys, steps, **BLOCKS)
        assert tokens.tolist() == [0, 517, 999] and logprobs.abs().max() == 0, (T, tokens, logprobs)
    tokens, logprobs = sample_triton(torch.full((2, 1000), float("-inf")), SamplingParams(), keys[:2], steps[:2])
    assert tokens.tolist() == [0, 0] and logprobs.isnan().all()  # all masked: defined token, NaN logprob

@check
def draws_follow_softmax():
    z = torch.tensor([1.0, 0.2, -0.5, 0.8, 0.0, -1.0, 0.5, -0.2])
    num, params = 320, SamplingParams(temperature=0.8)
    keys, steps = torch.full((num,), 12345), torch.arange(num)
    x = z.expand(num, -1)  # row stride 0
    tokens, logprobs = sample_triton(x, params, keys, steps, block=4, tiles=1)
    ref_tokens, ref_logprobs = sample_reference(x, params, keys, steps)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-6, rtol=0)
    expected = torch.softmax(z.double() / params.temperature, -1) * num
    chi2 = float(((torch.bincount(tokens, minlength=8).double() - expected) ** 2 / expected).sum())
    assert chi2 < 24.3, f"chi-square {chi2:.1f} over 7 dof: the draws do not follow softmax(z / T)"

@check
def sample_dispatches_to_the_kernel():
    x, (keys, steps) = logits_rows(6, 1000, torch.bfloat16, seed=3), draws(6, seed=3)
    params = SamplingParams(temperature=0.9)
    with use_fused_sampler(True):
        fused = sample(x, params, keys, steps)
        truncated = sample(x, SamplingParams(top_k=5), keys, steps)
    kernel = sample_triton(x, params, keys, steps)  # the engine's block sizes
    assert all(torch.equal(a, b) for a, b in zip(fused, kernel))
    assert all(torch.equal(a, b) for a, b in zip(truncated, sample_reference(x, SamplingParams(top_k=5), keys, steps)))
    y = x.t().contiguous().t()  # column stride != 1: sample copies it
    with use_fused_sampler(True):
        assert all(torch.equal(a, b) for a, b in zip(sample(y, params, keys, steps), kernel))

@check
def engine_generates_the_same_completions():
    model, prompts = tiny_model(), random_prompts([3, 6])
    for params in (SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=5),
                   SamplingParams(temperature=0, max_tokens=6)):
        outs = []
        for fused in (False, True):
            with use_fused_sampler(fused):
                outs.append(Engine(model, max_slots=4, max_len=16).generate(prompts, params))
        for g_ref, g_fused in zip(*outs):
            for a, b in zip(g_ref, g_fused):
                assert a.token_ids == b.token_ids, (params, a.token_ids, b.token_ids)
                torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-5, rtol=0)

print(json.dumps(results))
"""


# The script's checks in two processes, side by side: the first takes ~25 s under the interpreter, the rest ~18 s.
CHECK_SHARES = (
    ("tokens_and_logprobs_match_spec",),
    ("uniforms_are_counter_uniform_bit_for_bit", "greedy_matches_argmax_and_ties_take_the_first",
     "one_finite_logit_is_drawn_with_logprob_zero", "draws_follow_softmax", "sample_dispatches_to_the_kernel",
     "engine_generates_the_same_completions"),
)


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, str]:
    pytest.importorskip("triton")
    env = {"BOUNDARY_TOL": str(BOUNDARY_TOL), "MAX_BOUNDARY_FRACTION": str(MAX_BOUNDARY_FRACTION),
           "JETRL_FUSED_SAMPLER": None}
    results = {}
    for out in run_interpreted(*((INTERPRETER_SCRIPT, {**env, "CHECKS": ",".join(share)}) for share in CHECK_SHARES),
                               expect="{"):
        results.update(json.loads(out.strip().splitlines()[-1]))
    return results


@pytest.mark.parametrize("check", [check for share in CHECK_SHARES for check in share])
def test_kernel_in_interpreter(interpreter_results, check):
    assert interpreter_results.get(check) == "ok", interpreter_results.get(check, f"{check} did not run")


def test_every_interpreter_check_has_a_share():
    defined = re.findall(r"^@check\ndef (\w+)", INTERPRETER_SCRIPT, flags=re.MULTILINE)
    assert len(defined) > 5 and sorted(defined) == sorted(check for share in CHECK_SHARES for check in share)


# ----------------------------------------------------------------------------- backend and input checks (CPU)
def test_cpu_runs_the_reference_unless_forced(monkeypatch):
    x, keys = torch.randn(3, 50), torch.arange(3)
    monkeypatch.delenv("JETRL_FUSED_SAMPLER", raising=False)
    assert not uses_fused_sampler(x, SamplingParams())
    ref = sample_reference(x, SamplingParams(), keys, keys)
    assert all(torch.equal(a, b) for a, b in zip(sample(x, SamplingParams(), keys, keys), ref))
    with use_fused_sampler(True):
        assert not uses_fused_sampler(x, SamplingParams(top_p=0.9))  # truncation: always the reference
        assert not uses_fused_sampler(x.double(), SamplingParams())  # a dtype the kernel does not read
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1|needs Triton"):
            uses_fused_sampler(x, SamplingParams())
    monkeypatch.setenv("JETRL_FUSED_SAMPLER", "0")
    with use_fused_sampler(False):
        assert not uses_fused_sampler(x, SamplingParams())
    monkeypatch.setenv("JETRL_FUSED_SAMPLER", "on")
    with pytest.raises(ValueError, match="JETRL_FUSED_SAMPLER='on'"):
        sample(x, SamplingParams(), keys, keys)


@pytest.mark.parametrize("logits, keys, match", [
    (torch.randn(2, 3, 5), torch.arange(2), r"logits must be \(B, V\)"),
    (torch.randn(2, 0), torch.arange(2), r"V >= 1"),
    (torch.ones(2, 5, dtype=torch.int64), torch.arange(2), "float tensor"),
    (torch.randn(2, 5), torch.arange(3), r"keys must be \(2,\) int64"),
    (torch.randn(2, 5), torch.arange(2, dtype=torch.int32), r"keys must be \(2,\) int64"),
])
def test_bad_inputs_raise_actionable_errors(logits, keys, match):
    with pytest.raises((ValueError, TypeError), match=match):
        sample(logits, SamplingParams(), keys, torch.arange(2))


def test_gpu_kernels_compile_for_hopper():
    pytest.importorskip("triton")
    from jetrl.engine.kernels import sample_triton as st

    for greedy, scale in [(False, False), (False, True), (True, False)]:
        arg = "*i32" if greedy else "*fp32"
        constexprs = {"BLOCK": st.BLOCK, "TILES": st.TILES, "SCALE": scale, "GREEDY": greedy}
        compile_for_sm90(st._chunk_stats_kernel, constexprs, {"logits_ptr": "*bf16", "arg_ptr": arg},
                         floats=("inv_temperature",), num_warps=st.NUM_WARPS)
        compile_for_sm90(st._draw_kernel, {**constexprs, "BLOCK_C": 32},
                         {"logits_ptr": "*bf16", "arg_ptr": arg, "keys_ptr": "*i64", "steps_ptr": "*i64", "tokens_ptr": "*i64"}, floats=("inv_temperature",),
                         num_warps=st.NUM_WARPS)


# ----------------------------------------------------------------------------- GPU
@requires_cuda
@pytest.mark.parametrize("temperature", [1.0, 0.7, 0])
def test_kernel_matches_spec_on_gpu_at_rollout_size(temperature):
    pytest.importorskip("triton")
    from jetrl.engine.kernels.sample_triton import counter_uniform_triton, sample_triton

    namespace: dict = {}
    exec(HELPERS, namespace)  # noqa: S102 -- the shared mismatch_report
    g = torch.Generator(device="cuda").manual_seed(0)
    B, V = 256, 151936
    keys, steps = torch.randint(-(2**62), 2**62, (2, 10**5), device="cuda", generator=g)
    assert torch.equal(counter_uniform_triton(keys, steps), counter_uniform(keys, steps))
    x = (torch.randn(B, V, device="cuda", generator=g) * 3).to(torch.bfloat16)
    x[0, 1000:] = float("-inf")
    params = SamplingParams(temperature=temperature)
    total = boundary = 0
    for step in range(1 if params.is_greedy else 8):
        keys = torch.randint(0, 2**32, (B,), device="cuda", generator=g)
        steps = torch.full((B,), step, device="cuda")
        tokens, logprobs = sample_triton(x, params, keys, steps)
        ref_tokens, ref_logprobs = sample_reference(x, params, keys, steps)
        if params.is_greedy:
            assert torch.equal(tokens, ref_tokens)
            torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-5, rtol=0)
            continue
        n, dist = namespace["mismatch_report"](x, params, keys, steps, tokens, ref_tokens)
        assert dist <= BOUNDARY_TOL, f"a token differs from the spec {dist:.2e} away from a cdf boundary"
        total, boundary = total + B, boundary + n
        ref_lp = torch.log_softmax(x.float() / temperature, -1).gather(-1, tokens[:, None]).squeeze(-1)
        torch.testing.assert_close(logprobs, ref_lp, atol=1e-5, rtol=0)
        assert int(tokens[0]) < 1000
    assert boundary <= MAX_BOUNDARY_FRACTION_GPU * max(total, 1), f"{boundary} of {total} draws differ from the spec"
