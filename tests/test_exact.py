"""Exact mode (jetrl/exact.py): its kernels against their references, and on CUDA the claim itself.

CPU: the two batch-invariant kernels under TRITON_INTERPRET=1 against their fp32 references (attention:
causal, a padding mask, GQA, the decode fold, stale NaN keys, a KV cache's lengths and FP8 codes; linear: a K
tail, a bias), their sm_90 compile, and that exact mode changes nothing on CPU (the CPU is exact already).
CUDA: each kernel's rows are bit-identical at every M; and the engine's logprobs equal the trainer's bit
for bit under `bf16`, `jet` and `jet_kv`, while the off-policy `fp8kv_rollout` and `fp8_rollout` keep a gap.
"""

from __future__ import annotations

import pytest
import torch

from jetrl.exact import exact_active, exact_requested, use_exact

from .conftest import compile_for_sm90, requires_sm90
from .subprocesses import run_interpreted

INTERPRETER_SCRIPT = r"""
import torch
from jetrl.models.exact_ops import exact_attention_reference, exact_linear_reference
from jetrl.models.kernels.exact_attention_triton import exact_attention_triton
from jetrl.models.kernels.exact_linear_triton import exact_linear_triton

torch.manual_seed(0)
bf = torch.bfloat16
def close(a, b, tol):
    err = (a.float() - b.float()).abs().max().item()
    assert err <= tol, err
"""

# The kernels against their references, in two scripts run side by side: the linear kernels, then attention.
INTERPRETER_SCRIPTS = [INTERPRETER_SCRIPT + r"""
# linear: M not a tile multiple, a K tail (K = 200 is not a multiple of 64), bias
x, w, b = torch.randn(70, 200, dtype=bf), torch.randn(130, 200, dtype=bf) * 0.1, torch.randn(130, dtype=bf)
close(exact_linear_triton(x, w, b), exact_linear_reference(x, w, b), 0.07)
close(exact_linear_triton(x, w, None), exact_linear_reference(x, w), 0.07)
# the K runs (split_k.merge_splits): a tile's runs as separate programs or in one program, the same bits; a row of
# a small call equals the same row of a big one
x, w, b = torch.randn(70, 600, dtype=bf), torch.randn(130, 600, dtype=bf) * 0.1, torch.randn(130, dtype=bf)  # runs of 3, 3, 3, 1 steps
one = exact_linear_triton(x, w, b, programs_k=1)
close(one, exact_linear_reference(x, w, b), 0.07)
assert torch.equal(exact_linear_triton(x, w, b, programs_k=4), one)
assert torch.equal(exact_linear_triton(x[:3], w, b, programs_k=4), one[:3])
# exact mode's FP8 GEMM: the same two claims, and the emulated spec
from jetrl.fp8.gemm import gemm_emulated
from jetrl.fp8.kernels.gemm_exact_triton import gemm_exact
from jetrl.fp8.quant import quantize
for k, splits in ((1280, 4), (384, 3)):  # 10 groups: runs of 3, 3, 3, 1; 3 groups: 3 runs of 1
    x, wq = torch.randn(70, k), quantize(torch.randn(200, k) * 0.05, (128, 128))
    for col_major in (False, True):
        a, a3 = quantize(x, col_major_scales=col_major), quantize(x[:3], col_major_scales=col_major)
        one = gemm_exact(a.codes, a.scales, wq.codes, wq.scales, torch.float32, programs_k=1)
        ref = gemm_emulated(a, wq, torch.float32)
        assert float((one - ref).norm() / ref.norm()) < 1e-5
        assert torch.equal(gemm_exact(a.codes, a.scales, wq.codes, wq.scales, torch.float32, programs_k=splits), one)
        assert torch.equal(gemm_exact(a3.codes, a3.scales, wq.codes, wq.scales, torch.float32, programs_k=splits), one[:3])
try:
    gemm_exact(a.codes, a.scales, wq.codes, wq.scales, torch.float32, programs_k=2)
    raise AssertionError("programs_k=2 accepted")
except ValueError as e:
    assert "1 or this layer's 3 K splits" in str(e), e
print("OK")
""", INTERPRETER_SCRIPT + r"""
# attention: causal training shape with GQA (H = 4, Hkv = 2), T not a tile multiple
q, k, v = torch.randn(2, 4, 37, 32, dtype=bf), torch.randn(2, 2, 37, 32, dtype=bf), torch.randn(2, 2, 37, 32, dtype=bf)
ref = exact_attention_reference(q, k, v, causal=True)
close(exact_attention_triton(q, k, v, None, True, 32 ** -0.5), ref, 0.03)
# long enough for full key tiles (every key attended by every row of the tile: the kernel skips the masking there):
# a decode over the cache up to t (the kernel's own length bound) equals the causal row t bit for bit
# (G = 3: tiles of 5-6 positions; G = 16: a tile is one position, so its first position lands on every key tile's
# edge; t = 62 / 126 leave one key out of the decode's last tile)
for g in (3, 16):
    ql, kl, vl = (torch.randn(1, h, 150, 32, dtype=bf) for h in (g, 1, 1))
    full = exact_attention_triton(ql, kl, vl, None, True, 32 ** -0.5)
    close(full, exact_attention_reference(ql, kl, vl, causal=True), 0.03)
    for t in (0, 62, 63, 64, 70, 126, 127, 128, 149):
        step = exact_attention_triton(ql[:, :, t:t + 1], kl, vl, None, False, 32 ** -0.5, lengths=torch.tensor([t]))
        assert torch.equal(step, full[:, :, t:t + 1]), (g, t)
# the same through a padding-style bool mask (B, 1, T, S) with the diagonal always allowed
mask = torch.ones(2, 1, 37, 37, dtype=torch.bool).tril()
mask[1, :, :, :5] = False
mask |= torch.eye(37, dtype=torch.bool)
close(exact_attention_triton(q, k, v, mask, False, 32 ** -0.5), exact_attention_reference(q, k, v, mask), 0.03)
# decode: one query per row, a static cache of S = 90 whose positions past each row's length hold NaN
S, lengths = 90, torch.tensor([10, 70])
kc, vc = torch.randn(2, 2, S, 32, dtype=bf), torch.randn(2, 2, S, 32, dtype=bf)
for row, n in enumerate(lengths.tolist()):
    kc[row, :, n + 1:], vc[row, :, n + 1:] = float("nan"), float("nan")
dmask = (torch.arange(S)[None, :] <= lengths[:, None])[:, None, None, :]  # (B, 1, 1, S)
qd = torch.randn(2, 4, 1, 32, dtype=bf)
out = exact_attention_triton(qd, kc, vc, dmask, False, 32 ** -0.5)
assert torch.isfinite(out.float()).all()
close(out, exact_attention_reference(qd, kc, vc, dmask), 0.03)
# the model's decode fold (B, Hkv, G, D) against a (B, 1, 1, S) mask: the same rows, the same bits
folded = exact_attention_triton(qd.reshape(2, 2, 2, 32), kc, vc, dmask, False, 32 ** -0.5).reshape(2, 4, 1, 32)
assert torch.equal(folded, out)
# a KV cache's rows: keys 0..lengths[b] read by the kernel itself (no mask), the same bits as the masked call
assert torch.equal(exact_attention_triton(qd, kc, vc, None, False, 32 ** -0.5, lengths=lengths), out)
# an FP8 cache (pow2 scales as jet_kv's, and fp32 ones): codes and scales dequantized in the kernel equal the masked
# call over the dequantized cache bit for bit; stale positions hold NaN codes and NaN scales
from jetrl.fp8.kv_quant import dequantize_kv, quantize_kv
finite = torch.randn(2, 2, S, 32, dtype=bf)
for pow2 in (True, False):
    kq, vq = (quantize_kv(x, pow2_scale=pow2) for x in (finite, finite.flip(2)))
    codes = [x.codes.view(2, 2, S, 32).view(torch.uint8).clone() for x in (kq, vq)]
    scales = [x.scales.view(2, 2, S).clone() for x in (kq, vq)]
    for row, n in enumerate(lengths.tolist()):
        for c, sc in zip(codes, scales):
            c[row, :, n + 1:], sc[row, :, n + 1:] = 0x7F, float("nan")
    deq = [dequantize_kv(c.view(torch.float8_e4m3fn), sc, bf) for c, sc in zip(codes, scales)]
    masked = exact_attention_triton(qd, *deq, dmask, False, 32 ** -0.5)
    cached = exact_attention_triton(qd, *codes, None, False, 32 ** -0.5, lengths=lengths, k_scales=scales[0],
                                    v_scales=scales[1])
    assert torch.isfinite(cached.float()).all() and torch.equal(cached, masked), pow2
print("OK")
"""]


def test_exact_kernels_match_references_in_interpreter():
    pytest.importorskip("triton")
    run_interpreted(*INTERPRETER_SCRIPTS)


def test_exact_kernels_compile_for_sm90():
    pytest.importorskip("triton")
    from jetrl.models.kernels.exact_attention_triton import TILES as ATT
    from jetrl.models.kernels.exact_attention_triton import _exact_attention_kernel
    from jetrl.models.kernels.exact_linear_triton import TILES as LIN
    from jetrl.models.kernels.exact_linear_triton import _exact_linear_kernel

    bf = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "x_ptr", "w_ptr", "b_ptr")}
    compile_for_sm90(_exact_attention_kernel, {"D": 128, "BLOCK_M": ATT["BLOCK_M"], "BLOCK_N": ATT["BLOCK_N"],
                                               "EMULATE": False},
                     {**bf, "mask_ptr": "*u8", "kc_ptr": "*u8", "vc_ptr": "*u8", "len_ptr": "*i64"},
                     floats=("qk_scale",), num_warps=ATT["num_warps"])
    compile_for_sm90(_exact_linear_kernel, {"HAS_BIAS": True, "BLOCK_M": LIN["BLOCK_M"], "BLOCK_N": LIN["BLOCK_N"],
                                            "BLOCK_K": LIN["BLOCK_K"], "N": 4096, "K": 4096, "SPLITS": 4,
                                            "STEPS_PER_SPLIT": 16, "EMULATE": False}, {**bf, "count_ptr": "*i32"},
                     floats=("zero",), num_warps=LIN["num_warps"], num_stages=LIN["num_stages"])
    from jetrl.fp8.kernels.gemm_exact_triton import TILES as FP8
    from jetrl.fp8.kernels.gemm_exact_triton import _gemm_exact_kernel

    compile_for_sm90(_gemm_exact_kernel, {"SPLITS": 4, "GROUPS_PER_SPLIT": 8, "BLOCK_M": FP8["BLOCK_M"],
                                          "BLOCK_N": FP8["BLOCK_N"]},
                     {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "out_ptr": "*bf16", "count_ptr": "*i32"},
                     num_warps=FP8["num_warps"], num_stages=FP8["num_stages"])


def test_exact_mode_switch_and_cpu_passthrough():
    from jetrl.engine import SamplingParams
    from jetrl.models import CausalLM

    from .engine_helpers import LOGPROB_CONFIG, engine_vs_trainer_gap, random_prompts

    assert not exact_requested() and not exact_active("cuda")
    with use_exact():
        assert exact_requested() and exact_active("cuda") and not exact_active("cpu")
        with use_exact(False):
            assert not exact_requested()
        x, w = torch.randn(3, 8), torch.randn(5, 8)
        assert torch.equal(torch.nn.functional.linear(x, w), (x.double() @ w.double().t()).float())  # fp64 sums
        assert torch.equal(torch.nn.functional.linear(x.double(), w.double()), x.double() @ w.double().t())
        torch.manual_seed(0)
        gap = engine_vs_trainer_gap(CausalLM(LOGPROB_CONFIG), "jet_kv", random_prompts([5, 9], seed=1, vocab=512),
                                    SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=0))
        assert gap.numel() and gap.max().item() == 0.0  # the CPU stays bit-exact
    assert not exact_requested()


def test_toggling_exact_mode_recaptures_the_engines_graphs():
    """Graphs captured with the fast kernels must not be replayed in exact mode, nor the other way round."""
    from jetrl import fp8
    from jetrl.engine import Engine, SamplingParams

    from .engine_helpers import random_prompts, tiny_model
    from .test_engine_graphs import with_stand_in_graphs

    engine = Engine(fp8.convert_to_float8(tiny_model(), fp8.get_recipe("jet")), max_slots=4, max_len=32, sync_every=4)
    graphs = with_stand_in_graphs(engine)
    prompts, params = random_prompts([4, 6]), SamplingParams(max_tokens=6, seed=0)
    engine.generate(prompts, params)
    assert graphs.num_resets == 1
    with use_exact():
        engine.generate(prompts, params)
    assert graphs.num_resets == 2
    engine.generate(prompts, params)
    assert graphs.num_resets == 3


def test_exact_mode_rejects_what_its_kernels_cannot_run():
    from jetrl.models.exact_ops import _attention_problem

    q = torch.empty(1, 4, 8, 24, dtype=torch.bfloat16)
    assert "power of two" in _attention_problem(q, q[:, :2], q[:, :2], None, 0.0, False, True)
    q = torch.empty(1, 4, 8, 32, dtype=torch.bfloat16)
    assert "dropout" in _attention_problem(q, q, q, None, 0.1, False, False)
    assert "enable_gqa" in _attention_problem(q, q[:, :2], q[:, :2], None, 0.0, False, False)
    assert "bool" in _attention_problem(q, q, q, torch.zeros(1, 1, 8, 8), 0.0, False, False)
    assert _attention_problem(q, q[:, :2], q[:, :2], torch.ones(1, 1, 8, 8, dtype=torch.bool), 0.0, False, True) is None
    # exact mode's FP8 GEMM takes only a forward's 128x128 weight blocks: a 1x128 b raises instead of falling back
    from jetrl.fp8.gemm import _gemm_exact
    from jetrl.fp8.quant import quantize

    x = torch.randn(4, 256)
    with pytest.raises(ValueError, match="128x128 weight blocks"):
        _gemm_exact(quantize(x), quantize(x), torch.bfloat16)
    # the decode step over a cache (exact_cache_attention)
    from jetrl.models.exact_ops import _cache_problem

    qd, cache, lengths = torch.empty(2, 4, 1, 32, dtype=torch.bfloat16), torch.empty(2, 2, 64, 32), torch.zeros(2)
    codes, scales = cache.to(torch.uint8), torch.empty(2, 2, 64)
    assert "one decode query" in _cache_problem(q[:, :, :2], cache, cache, lengths.long(), None, None)
    assert "int64" in _cache_problem(qd, cache.bfloat16(), cache.bfloat16(), lengths, None, None)
    assert "model-dtype cache" in _cache_problem(qd, cache, cache, lengths.long(), None, None)
    assert "FP8 cache" in _cache_problem(qd, codes, codes, lengths.long(), scales, None)
    assert _cache_problem(qd, codes, codes, lengths.long(), scales, scales) is None


def test_exact_fp8_gemm_kernel_is_chosen_by_the_layer(monkeypatch):
    """Exact mode's FP8 GEMM takes the Gluon kernel for a layer with K a multiple of 256 on an SM90 GPU with Gluon: a
    property of the layer's shape, never of M nor of the codes' layout (on any other machine, the Triton one)."""
    from jetrl.fp8 import gemm as gemm_module
    from jetrl.fp8.quant import quantize

    w = quantize(torch.randn(256, 512), (128, 128))
    assert not gemm_module._exact_takes_gluon(w)  # a CPU tensor
    monkeypatch.setattr(gemm_module, "_is_sm90", lambda device: True)
    monkeypatch.setattr(gemm_module, "has_gluon", lambda: True)
    assert gemm_module._exact_takes_gluon(w)
    assert not gemm_module._exact_takes_gluon(quantize(torch.randn(256, 384), (128, 128)))  # K % 256
    strided = type(w)(w.codes[:, ::2], w.scales[:, :2], w.block)  # column stride 2: copied, not sent elsewhere
    assert gemm_module._exact_takes_gluon(strided)


def test_exact_gemms_k_runs_and_split_limits():
    """The K runs are a function of K alone (K = 0: one empty run); a split whose workspace would pass the kernels'
    32-bit offsets, or a program count other than 1 or the layer's runs, raises instead of launching."""
    pytest.importorskip("triton")
    from jetrl.fp8.kernels.split_k import k_splits, split_buffers

    assert k_splits(96, 4) == (4, 24) and k_splits(10, 4) == (4, 3) and k_splits(3, 4) == (3, 1) and k_splits(0, 4) == (1, 1)
    with pytest.raises(ValueError, match="fewer than 2\\*\\*31"):
        split_buffers(16, 4, 2**20, 2**10, torch.device("cpu"), programs_k=4)
    with pytest.raises(ValueError, match="1 or this layer's 4 K splits"):
        split_buffers(16, 4, 64, 512, torch.device("cpu"), programs_k=2)


# ----------------------------------------------------------------------------- on the GPU
@requires_sm90
def test_exact_kernels_are_batch_invariant_on_gpu():
    """Row r of a big call equals row r of a small call, bit for bit, for every exact kernel."""
    from jetrl.fp8.gemm import fp8_gemm
    from jetrl.fp8.quant import quantize

    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    x, w = torch.randn(1000, 512, device=dev, dtype=bf), torch.randn(768, 512, device=dev, dtype=bf) * 0.05
    with use_exact():
        big = torch.nn.functional.linear(x, w)
        for m in (1, 7, 64, 256):
            assert torch.equal(torch.nn.functional.linear(x[:m], w), big[:m]), m
        # a GEMM's K runs as separate programs or in one (split_k.merge_splits), also with one step per run (K = 256,
        # where a literal-zero accumulator let the compiler fold the run's dot into the running total)
        from jetrl.fp8.kernels.gemm_exact_triton import gemm_exact
        from jetrl.models.kernels.exact_linear_triton import exact_linear_triton

        for k in (256, 512, 4096):
            xk, wk = torch.randn(16, k, device=dev, dtype=bf), torch.randn(512, k, device=dev, dtype=bf) * 0.05
            assert torch.equal(exact_linear_triton(xk, wk, None, programs_k=4), exact_linear_triton(xk, wk, None, 1)), k
            a, wq = quantize(xk), quantize(wk, (128, 128))
            splits = min(4, k // 128)
            assert torch.equal(gemm_exact(a.codes, a.scales, wq.codes, wq.scales, programs_k=splits),
                               gemm_exact(a.codes, a.scales, wq.codes, wq.scales, programs_k=1)), k
        from jetrl.fp8.kernels.split_k import _counters

        assert int(_counters[torch.device(dev, torch.cuda.current_device())].abs().sum()) == 0  # left at 0
        # the FP8 GEMM: K = 512 takes the Gluon kernel (its tiles change at 64 and 256 rows, its bits do not), K = 384
        # the Triton exact kernel; a misaligned view of the activation codes is copied, not sent elsewhere
        from jetrl.fp8 import gemm as gemm_module

        gluon = gemm_module._is_sm90(torch.device(dev)) and gemm_module.has_gluon()  # else Triton for both
        for k in (512, 384):
            xk, wq = x[:, :k].contiguous(), quantize(w[:, :k].contiguous(), (128, 128))
            assert gemm_module._exact_takes_gluon(wq) == (gluon and k == 512)
            big = fp8_gemm(quantize(xk), wq)
            for m in (1, 16, 64, 200, 256, 300):
                assert torch.equal(fp8_gemm(quantize(xk[:m]), wq), big[:m]), (k, m)

            def shifted(t):  # a copy 8 bytes past a 16-byte boundary: TMA cannot read it
                out = torch.empty(t.numel() + 8, dtype=t.dtype, device=dev)[8:].view(t.shape)
                return out.copy_(t)

            a = quantize(xk[:65])
            assert torch.equal(fp8_gemm(type(a)(shifted(a.codes), a.scales, a.block), wq), big[:65]), k
            assert torch.equal(fp8_gemm(a, type(wq)(shifted(wq.codes), wq.scales, wq.block)), big[:65]), k
        # attention: position t of a causal forward over T tokens = a decode step at t over a static cache
        B, H, Hkv, T, D, S = 3, 8, 2, 200, 128, 256
        q, k, v = (torch.randn(B, h, T, D, device=dev, dtype=bf) for h in (H, Hkv, Hkv))
        full = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        cache_k = torch.full((B, Hkv, S, D), float("nan"), device=dev, dtype=bf)
        cache_v = cache_k.clone()
        cache_k[:, :, :T], cache_v[:, :, :T] = k, v
        for t in (0, 63, 64, 150, T - 1):
            mask = (torch.arange(S, device=dev) <= t)[None, None, None, :]
            step = torch.nn.functional.scaled_dot_product_attention(
                q[:, :, t:t + 1].reshape(B, Hkv, H // Hkv, D), cache_k, cache_v, attn_mask=mask)
            assert torch.equal(step.reshape(B, H, D), full[:, :, t]), t
        # the engine's exact decode (exact_cache_attention): each row at its own position, over a model-dtype cache
        # and over an FP8 one whose codes and scales the kernel dequantizes (the trainer: SDPA on deq(q(K)), deq(q(V)))
        from jetrl.fp8.kv_quant import dequantize_kv, quantize_kv
        from jetrl.models.exact_ops import exact_cache_attention

        lengths, rows = torch.tensor([0, 150, T - 1], device=dev), torch.arange(B, device=dev)
        q_step = q[rows, :, lengths].unsqueeze(2)  # (B, H, 1, D): row b at position lengths[b]
        assert torch.equal(exact_cache_attention(q_step, cache_k, cache_v, lengths)[:, :, 0], full[rows, :, lengths])
        for pow2 in (True, False):
            quantized = [quantize_kv(x, pow2_scale=pow2) for x in (k, v)]
            codes = [torch.full((B, Hkv, S, D), 0x7F, device=dev, dtype=torch.uint8) for _ in range(2)]
            scales = [torch.full((B, Hkv, S), float("nan"), device=dev) for _ in range(2)]
            for c, sc, x in zip(codes, scales, quantized):
                c[:, :, :T], sc[:, :, :T] = x.codes.view(B, Hkv, T, D).view(torch.uint8), x.scales.view(B, Hkv, T)
            k_hat, v_hat = (dequantize_kv(x.codes.view(B, Hkv, T, D), x.scales.view(B, Hkv, T), bf) for x in quantized)
            full_q = torch.nn.functional.scaled_dot_product_attention(q, k_hat, v_hat, is_causal=True, enable_gqa=True)
            step = exact_cache_attention(q_step, *codes, lengths, *scales)[:, :, 0]
            assert torch.equal(step, full_q[rows, :, lengths]), pow2


def _gpu_gaps(recipe: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    from jetrl.engine import SamplingParams
    from jetrl.models import CausalLM

    from .engine_helpers import LOGPROB_CONFIG, engine_vs_trainer_gap, random_prompts

    torch.manual_seed(0)
    base = CausalLM(LOGPROB_CONFIG).to("cuda", dtype)
    prompts = random_prompts([5, 17, 33, 9], seed=1, vocab=512)
    with use_exact():
        return engine_vs_trainer_gap(base, recipe, prompts, SamplingParams(n=4, temperature=1.0, max_tokens=48, seed=0))


@requires_sm90
@pytest.mark.parametrize(("recipe", "dtype"), [("bf16", torch.bfloat16), ("jet", torch.bfloat16),
                                               ("jet_kv", torch.bfloat16), ("jet_kv", torch.float32)])
def test_exact_mode_engine_logprobs_equal_trainer_on_gpu(recipe, dtype):
    gap = _gpu_gaps(recipe, dtype)
    print(f"exact {recipe} {dtype}: {gap.numel()} tokens, max |engine - trainer| {gap.max().item():.3g}")
    assert gap.numel() == 16 * 48 and gap.max().item() == 0.0


@requires_sm90
@pytest.mark.parametrize("recipe", ["fp8kv_rollout", "fp8_rollout"])
def test_exact_mode_keeps_the_off_policy_gap_on_gpu(recipe):
    gap = _gpu_gaps(recipe)
    print(f"exact {recipe}: mean |engine - trainer| {gap.mean().item():.3g}")
    assert gap.mean().item() > 1e-3
