"""The unified FP8 KV cache (issue 6) on CPU: one K/V quantizer for the trainer and the engine.

1. ``quantize_kv`` / ``dequantize_kv``: per-token-head groups through the one quantizer, the
   round-trip bound, the NaN/Inf policy; the straight-through gradient of the trainer's fake-quant.
2. Where the transform applies: ``jet_kv`` quantizes K/V in the trainer's forward, ``fp8kv_rollout``
   only in the rollout, ``jet`` nowhere (it stays exactly the paper's recipe).
3. The engine's FP8 cache holds K/V codes and scales bit-identical (uint8/int32 views) to the ones
   the trainer's forward produces for the same tokens -- prompt (prefill + fork) and generated
   (decode) positions alike. (The logprob gaps per recipe are in tests/test_engine.py.)
4. The fused-decode protocol (``DecodeView.attend``, the GPU path) wired through the model, run on
   CPU with a stand-in for the kernel.
"""

from __future__ import annotations

import pytest
import torch

from jetrl import fp8
from jetrl.engine import Engine, SamplingParams, StaticKVCache
from jetrl.fp8.kv_quant import dequantize_kv, fake_quantize_kv, quantize_dequantize_kv, quantize_kv
from jetrl.fp8.quant import amax_to_scale, quantize_reference, record_quantization
from jetrl.models import CausalLM, ModelConfig

VOCAB = 256


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t.view(torch.int32)


def _kv_like(shape, seed=0, dtype=torch.float32):
    """Random K/V whose token-head groups span six orders of magnitude (and one all-zero group)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 10.0 ** torch.randint(-3, 3, shape[:-1], generator=g)[..., None]
    x[0, 0, 0] = 0.0
    return x.to(dtype)


def _model(head_dim: int, arch: str = "llama", seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    extra = {"qk_norm": True, "architecture": "Qwen3ForCausalLM"} if arch == "qwen3" else {}
    return CausalLM(ModelConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, **extra))


# ----------------------------------------------------------------------------- 1. the quantizer pair
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("pow2", [False, True])
def test_quantize_kv_is_the_one_quantizer_per_token_head(head_dim, pow2):
    x = _kv_like((3, 2, 7, head_dim))  # (B, Hkv, T, D)
    q = quantize_kv(x, pow2_scale=pow2, name="layers.0.k")
    assert q.block == (1, head_dim) and q.codes.shape == (42, head_dim) and q.scales.shape == (42, 1)
    # the same codes and scales as the reference spec with a (1, head_dim) block
    codes, scales = quantize_reference(x.reshape(-1, head_dim), 1, head_dim, pow2)
    assert torch.equal(_bits(q.codes), _bits(codes)) and torch.equal(_bits(q.scales), _bits(scales))
    # one scale per token per kv head: amax / 448 of that head_dim vector
    expected = amax_to_scale(x.abs().amax(-1), pow2)  # (B, Hkv, T)
    assert torch.equal(_bits(q.scales.view(3, 2, 7)), _bits(expected))
    # round trip: |x - deq| <= 2^-4 |x| + 2^-10 s per element (quant.py's bound), zero group exact
    s = q.scales.view(3, 2, 7, 1)
    deq = dequantize_kv(q.codes.view(x.shape), q.scales.view(x.shape[:-1]), torch.float32)
    assert ((x - deq).abs() <= 2**-4 * x.abs() + 2**-10 * s + 1e-30).all()
    assert (deq[0, 0, 0] == 0).all()
    if pow2:  # the dequantization is then an exact exponent shift
        assert torch.equal(deq, q.codes.view(x.shape).double().mul(s.double()).float())


def test_dequantize_kv_is_one_fp32_product_then_one_cast():
    x = _kv_like((2, 2, 5, 64), seed=1, dtype=torch.bfloat16)
    q = quantize_kv(x)
    codes, scales = q.codes.view(x.shape), q.scales.view(x.shape[:-1])
    out = dequantize_kv(codes, scales, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, (codes.float() * scales[..., None]).to(torch.bfloat16))
    assert torch.equal(quantize_dequantize_kv(x), out)  # what the trainer sees == what the cache returns
    with pytest.raises(ValueError, match="float8_e4m3fn codes"):
        dequantize_kv(codes.float(), scales, torch.float32)
    with pytest.raises(ValueError, match=r"\(\.\.\., head_dim\)"):
        quantize_kv(torch.ones(64))


def test_nonfinite_kv_propagates_per_token_head():
    x = _kv_like((1, 2, 4, 64), seed=2)
    x[0, 1, 2, 5] = float("nan")
    x[0, 0, 3, 0] = float("-inf")
    q = quantize_kv(x)
    bad = torch.zeros(1, 2, 4, dtype=torch.bool)
    bad[0, 1, 2] = bad[0, 0, 3] = True
    scales = q.scales.view(1, 2, 4)
    assert torch.equal(torch.isnan(scales), bad)  # only the two groups that hold NaN/Inf
    assert (q.codes.view(1, 2, 4, 64)[bad].view(torch.uint8) == 0x7F).all()  # canonical NaN codes
    y = fake_quantize_kv(x)
    assert torch.isnan(y[bad]).all() and torch.isfinite(y[~bad]).all()  # propagates, never saturates


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_quant_forward_is_the_cache_values_and_backward_is_straight_through(dtype):
    x = _kv_like((2, 2, 6, 64), seed=3, dtype=dtype).requires_grad_(True)
    y = fake_quantize_kv(x, name="layers.0.k")
    assert y.dtype == dtype and torch.equal(y, quantize_dequantize_kv(x.detach()))
    assert not torch.equal(y, x)  # it does quantize
    weight = torch.randn(x.shape).to(dtype)
    (y * weight).sum().backward()
    assert torch.equal(x.grad, weight)  # identity: dL/dx = dL/dy, in the model dtype


# ----------------------------------------------------------------------------- 2. where the transform applies
def _kv_records(model, ids, phase):
    with torch.no_grad(), fp8.precision_phase(phase), record_quantization() as log:
        model(ids)
    return [name for name, _ in log if name.endswith((".k", ".v"))]


def test_kv_transform_per_recipe_and_phase():
    ids = torch.randint(0, VOCAB, (2, 11))
    expected = {  # (train, rollout) forwards without a cache
        "jet": ([], []),
        "jet_kv": (["layers.0.k", "layers.0.v", "layers.1.k", "layers.1.v"],) * 2,
        "fp8kv_rollout": ([], ["layers.0.k", "layers.0.v", "layers.1.k", "layers.1.v"]),
    }
    for name, (train, rollout) in expected.items():
        model = fp8.convert_to_float8(_model(64), fp8.get_recipe(name))
        installed = [layer.self_attn.kv_quant for layer in model.model.layers]
        assert all(t is None for t in installed) if name == "jet" else all(t is not None for t in installed)
        assert (_kv_records(model, ids, "train"), _kv_records(model, ids, "rollout")) == (train, rollout), name
        assert fp8.model_recipe(model) == fp8.get_recipe(name)
    # fp8kv_rollout has no FP8 linear layer, yet the transform is installed and names the recipe
    off = fp8.convert_to_float8(_model(64), fp8.get_recipe("fp8kv_rollout"))
    assert not fp8.float8_modules(off) and fp8.model_recipe(off).name == "fp8kv_rollout"
    assert fp8.model_recipe(_model(64)) is None
    with pytest.raises(ValueError, match="installed with recipe 'fp8kv_rollout'.*run uses 'bf16'"):
        fp8.check_model_precision(off, fp8.get_recipe("bf16"))
    with pytest.raises(ValueError, match="quantizes K/V but the model has no KV transform"):
        fp8.check_model_precision(_model(64), fp8.get_recipe("jet_kv"))


def test_jet_kv_trains_through_quantized_kv():
    """The trainer's loss is computed on FP8 K/V (it differs from jet's), and W_k, W_v still get gradients."""
    ids = torch.randint(0, VOCAB, (2, 13))
    losses = {}
    for name in ("jet", "jet_kv"):
        model = fp8.convert_to_float8(_model(64, "qwen3", seed=4), fp8.get_recipe(name))
        loss = model(ids).logsumexp(-1).mean()
        loss.backward()
        losses[name] = loss.item()
        for proj in ("k_proj", "v_proj"):
            grad = getattr(model.model.layers[0].self_attn, proj).weight.grad
            assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
    assert losses["jet"] != losses["jet_kv"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype, pow2", [(torch.bfloat16, True), (torch.float32, False), (torch.float16, True)])
def test_fused_fake_quant_on_cuda_is_the_reference_path_bit_for_bit(dtype, pow2):
    """On CUDA ``quantize_dequantize_kv`` is one Triton pass; it must give the CPU reference's values (NaN where
    a group holds NaN/Inf), keep the input's layout, and show the recorders the reference's codes and scales."""
    pytest.importorskip("triton")
    k = _kv_like((2, 8, 300, 128), dtype=dtype)
    v = _kv_like((2, 300, 8, 128), seed=1, dtype=dtype).transpose(1, 2)  # the trainer's V: a transposed view
    k[1, 3, 7, 5] = float("nan")
    for x in (k, v):
        want = quantize_dequantize_kv(x, pow2_scale=pow2, name="layers.0.k")  # CPU: quantize_kv + dequantize_kv
        ref = quantize_kv(x, pow2_scale=pow2)
        with record_quantization() as log:
            got = quantize_dequantize_kv(x.cuda(), pow2_scale=pow2, name="layers.0.k")
        assert got.dtype == dtype and got.stride() == x.stride()
        got, nan = got.cpu(), want.isnan()
        assert torch.equal(got.isnan(), nan)
        as_int = {2: torch.int16, 4: torch.int32}[got.element_size()]
        assert torch.equal(got[~nan].view(as_int), want[~nan].view(as_int))  # bits: -0.0 too
        ((name, q),) = log
        assert name == "layers.0.k" and torch.equal(_bits(q.codes.cpu()), _bits(ref.codes))
        assert torch.equal(_bits(q.scales.cpu()), _bits(ref.scales))


# ----------------------------------------------------------------------------- 3. engine cache == trainer codes
@pytest.mark.parametrize("head_dim, arch", [(64, "llama"), (128, "qwen3")])
def test_engine_fp8_cache_is_bit_identical_to_the_trainer_forward(head_dim, arch):
    """Prompt positions (prefill, forked to the group's second sample) and generated positions (decode)."""
    model = fp8.convert_to_float8(_model(head_dim, arch, seed=1), fp8.get_recipe("jet_kv"))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 14, 9)]
    engine = Engine(model, max_slots=6, max_len=32)
    out = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=0))
    cache = engine.cache
    L, S, Hkv, max_len, D = cache.k.shape
    assert cache.is_fp8 and cache.k.dtype == torch.float8_e4m3fn and cache.k_scale.shape == (L, S, Hkv, max_len)
    assert cache.nbytes == 2 * L * S * Hkv * max_len * (D + 4)  # codes + one fp32 scale per token-head

    num_checked = 0
    for i, group in enumerate(out):
        for j, completion in enumerate(group):
            slot = 2 * i + j  # all groups fit at once: admission order, lowest free slot first
            tokens = prompts[i] + completion.token_ids
            n = len(tokens) - 1  # the last sampled token's K/V is written only if the row ran on frozen
            with torch.no_grad(), record_quantization() as log:
                model(torch.tensor([tokens]))  # the trainer's forward ("train" phase)
            records = {name: q for name, q in log if name.endswith((".k", ".v"))}
            assert len(records) == 2 * L
            for layer in range(L):
                for which, codes, scales in (("k", cache.k, cache.k_scale), ("v", cache.v, cache.v_scale)):
                    q = records[f"layers.{layer}.{which}"]
                    trainer_codes = q.codes.view(Hkv, len(tokens), D)[:, :n]
                    trainer_scales = q.scales.view(Hkv, len(tokens))[:, :n]
                    assert torch.equal(_bits(codes[layer, slot, :, :n]), _bits(trainer_codes)), (i, j, layer, which)
                    assert torch.equal(_bits(scales[layer, slot, :, :n]), _bits(trainer_scales)), (i, j, layer, which)
            num_checked += n
    assert num_checked > 3 * 2 * 10  # prompt and generated positions of every sequence


def test_bf16_kv_recipes_keep_a_model_dtype_cache():
    for name in ("bf16", "jet", "fp8_rollout"):
        engine = Engine(fp8.convert_to_float8(_model(64), fp8.get_recipe(name)), max_slots=2, max_len=8)
        assert not engine.cache.is_fp8 and engine.cache.k.dtype == torch.float32 and engine.cache.k_scale is None
    engine = Engine(fp8.convert_to_float8(_model(64), fp8.get_recipe("fp8kv_rollout")), max_slots=2, max_len=8)
    assert engine.cache.is_fp8  # the rollout's KV op decides, not the linear layers
    with pytest.raises(ValueError, match="use_decode_kernel=True.*CUDA"):
        Engine(_model(64), max_slots=2, max_len=8, use_decode_kernel=True)


# ----------------------------------------------------------------------------- 4. the fused-decode protocol
def _reference_decode_attention(q, k, v, lengths, *, k_scales=None, v_scales=None, sm_scale=None, pow2_scales=False,
                                row_order=None, quantized=None):
    """Stand-in for jetrl.engine.decode_attention.decode_attention with its documented contract (``quantized``:
    o_proj's FP8 input buffers, which the producer slots ask for on CUDA only)."""
    assert quantized is None, "no producer buffers off CUDA (jetrl/fp8/producer_quant.py)"
    H, (Hkv, S) = q.shape[1], k.shape[1:3]
    if k_scales is not None:
        k, v = dequantize_kv(k, k_scales, q.dtype), dequantize_kv(v, v_scales, q.dtype)
    k, v = k.double().repeat_interleave(H // Hkv, 1), v.double().repeat_interleave(H // Hkv, 1)
    scores = torch.einsum("bhd,bhsd->bhs", q.double(), k) * sm_scale
    scores = scores.masked_fill(torch.arange(S)[None, None, :] > lengths[:, None, None], float("-inf"))
    return torch.einsum("bhs,bhsd->bhd", scores.softmax(-1), v).to(q.dtype)


@pytest.mark.parametrize("recipe", ["jet_kv", "bf16"])
def test_decode_view_attend_protocol_matches_the_reference_path(monkeypatch, recipe):
    """``DecodeView.attend`` (used on CUDA) stores K/V like ``update`` and hands the kernel the cache rows."""
    import sys
    import types

    calls = []

    def kernel(q, k, v, lengths, **kwargs):
        calls.append((k, v, kwargs))
        return _reference_decode_attention(q, k, v, lengths, **kwargs)

    from jetrl.engine.decode_attention import longest_first

    monkeypatch.setitem(sys.modules, "jetrl.engine.decode_attention",
                        types.SimpleNamespace(decode_attention=kernel, longest_first=longest_first))
    model = fp8.convert_to_float8(_model(64, seed=2), fp8.get_recipe(recipe))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (4, 11, 7)]
    params = SamplingParams(n=2, temperature=0, max_tokens=8)
    reference = Engine(model, max_slots=6, max_len=24)
    expected = reference.generate(prompts, params)
    fused = Engine(model, max_slots=6, max_len=24)
    fused.cache.use_decode_kernel = True  # what the engine sets on CUDA with Triton
    out = fused.generate(prompts, params)

    assert len(calls) == fused.stats.num_decode_steps * model.config.num_hidden_layers
    k, v, kwargs = calls[0]
    if recipe == "jet_kv":
        assert k.dtype == v.dtype == torch.float8_e4m3fn
        assert kwargs["k_scales"].dtype == kwargs["v_scales"].dtype == torch.float32
        # the cache declares its power-of-two scales, and they are
        scales = kwargs["k_scales"]
        assert kwargs["pow2_scales"] and torch.equal(scales, torch.exp2(torch.log2(scales).round()))
    else:
        assert k.dtype == v.dtype == torch.float32 and kwargs["k_scales"] is None and kwargs["v_scales"] is None
        assert not kwargs["pow2_scales"]
    # strided views of the cache, not copies
    assert k.data_ptr() == fused.cache.k[0].data_ptr() and v.data_ptr() == fused.cache.v[0].data_ptr()
    assert kwargs["sm_scale"] == 64 ** -0.5
    # one program order per step, shared by its layers: the rows, longest first
    orders = [c[2]["row_order"] for c in calls]
    assert all(o is orders[0] for o in orders[: model.config.num_hidden_layers])
    assert sorted(orders[0].tolist()) == list(range(len(orders[0])))
    for a, b in zip(expected, out):
        for ca, cb in zip(a, b):
            assert ca.token_ids == cb.token_ids
            torch.testing.assert_close(torch.tensor(ca.logprobs), torch.tensor(cb.logprobs), atol=1e-5, rtol=0)
    assert torch.equal(_bits(fused.cache.k), _bits(reference.cache.k))  # attend stored what update stores
    if recipe == "jet_kv":
        assert torch.equal(_bits(fused.cache.k_scale), _bits(reference.cache.k_scale))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("pow2", [True, False])
def test_prefill_store_on_cuda_is_the_reference_store_bit_for_bit(pow2):
    """On CUDA a prefill quantizes, stores and decodes K/V in one Triton pass per tensor (store_quantized_kv); the
    cache's codes and scales, and what attention reads, must be the CPU reference path's, bit for bit."""
    pytest.importorskip("triton")
    k = _kv_like((3, 8, 40, 128), seed=7, dtype=torch.bfloat16)
    v = _kv_like((3, 40, 8, 128), seed=8, dtype=torch.bfloat16).transpose(1, 2)  # the model's layout: a view
    k[1, 2, 5, 9] = float("nan")
    slots, lengths = torch.tensor([4, 0, 2]), torch.tensor([40, 33, 17])
    caches, reads = [], []
    for device in ("cpu", "cuda"):
        cache = StaticKVCache(2, 5, 8, 48, 128, torch.bfloat16, device, kv_spec=fp8.KVCacheSpec(pow2_scale=pow2))
        reads.append([t.cpu() for t in cache.prefill(slots.to(device), lengths.to(device)).update(1, k.to(device),
                                                                                               v.to(device))])
        caches.append(cache)
    cpu, gpu = caches
    for name in ("k", "v", "k_scale", "v_scale"):
        want, got = getattr(cpu, name), getattr(gpu, name).cpu()
        assert torch.equal(_bits(got[1, slots, :, :40]), _bits(want[1, slots, :, :40])), name
    assert reads[0][0].isnan().any()  # the NaN's token-head decodes to NaN on both paths
    for want, got in zip(*reads):
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan)
        assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))  # bf16 bits


def test_static_cache_stores_fp8_through_byte_views():
    cache = StaticKVCache(1, 3, 2, 6, 64, torch.float32, "cpu", kv_spec=fp8.KVCacheSpec())
    k, v = _kv_like((2, 2, 4, 64), seed=5), _kv_like((2, 2, 4, 64), seed=6)
    read_k, read_v = cache.prefill(torch.tensor([2, 0]), torch.tensor([4, 3])).update(0, k, v)
    assert torch.equal(read_k, quantize_dequantize_kv(k)) and torch.equal(read_v, quantize_dequantize_kv(v))
    q = quantize_kv(k)
    assert torch.equal(_bits(cache.k[0, 2, :, :4]), _bits(q.codes.view(k.shape)[0]))
    cache.fork(torch.tensor([2]), torch.tensor([1]), 4)
    assert torch.equal(_bits(cache.k[0, 1, :, :4]), _bits(cache.k[0, 2, :, :4]))
    assert torch.equal(cache.k_scale[0, 1, :, :4], cache.k_scale[0, 2, :, :4]) and cache.lengths[1] == 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_quantize_kv_of_more_than_65535_row_tiles_on_gpu():
    """2.2M token-heads (e.g. 64 sequences x 8 kv heads x 4.3K tokens) fit in the quantizer's grid: its row tiles no
    longer sit on a grid axis capped at 65535 (the launch failed with 'invalid argument'); the last rows are the
    reference's bit for bit."""
    pytest.importorskip("triton")
    x = torch.randn(2_200_000, 128, device="cuda", dtype=torch.bfloat16)
    q = quantize_kv(x)
    codes, scales = quantize_reference(x[-1000:], 1, 128, False)
    assert torch.equal(_bits(q.codes[-1000:]), _bits(codes)) and torch.equal(_bits(q.scales[-1000:]), _bits(scales))
