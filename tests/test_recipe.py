"""Recipes, the rollout-subgraph check, the FP8 transform, and the single-quantizer proof."""

import dataclasses

import pytest
import torch
import torch.nn as nn

import jetrl.fp8.linear as linear_mod
from jetrl.fp8 import (
    RECIPE_NAMES,
    Float8Linear,
    KVCacheSpec,
    LinearPrecision,
    OffPolicyRecipeError,
    QuantSpec,
    check_model_precision,
    check_rollout_subgraph,
    convert_to_float8,
    get_recipe,
    precision_phase,
)
from jetrl.fp8.export import fp8_quantization_config, fp8_state_dict
from jetrl.models import CausalLM, ModelConfig


def _u8(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t.view(torch.int32)


def _tiny_model(seed=0, hidden=256):
    torch.manual_seed(seed)
    config = ModelConfig(
        vocab_size=96, hidden_size=hidden, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, qk_norm=True, architecture="Qwen3ForCausalLM", head_dim=64,
    )
    return CausalLM(config)


def test_recipes_on_policy_flags():
    assert set(RECIPE_NAMES) == {"bf16", "fp8_rollout", "jet", "jet_kv", "fp8kv_rollout"}
    assert check_rollout_subgraph(get_recipe("bf16"))["on_policy"]
    assert check_rollout_subgraph(get_recipe("jet"))["on_policy"]
    off = get_recipe("fp8_rollout")
    report = check_rollout_subgraph(off)  # allowed: declared off-policy
    assert not report["on_policy"] and report["mismatched_ops"] == ["linear.input", "linear.weight"]
    meta = off.metadata()
    assert meta["declared_off_policy"] and not meta["on_policy"]
    jet = get_recipe("jet").metadata()
    assert jet["on_policy"] and jet["train_fp8_backward"] and not jet["declared_off_policy"]
    assert not (jet["train_fp8_kv"] or jet["rollout_fp8_kv"])


def test_kv_cache_recipes():
    jet, jet_kv, off = get_recipe("jet"), get_recipe("jet_kv"), get_recipe("fp8kv_rollout")
    # jet is exactly the paper's recipe: every non-linear op BF16, no KV spec in either phase
    assert jet.ops == dict.fromkeys(("embedding", "lm_head", "norm", "attention", "kv_cache"), "bf16")
    assert jet.rollout_ops is None and jet.kv_cache("train") is None and jet.kv_cache("rollout") is None
    # jet_kv = jet + the same FP8 KV spec in both phases: on-policy, the KV op takes part in the check
    assert (jet_kv.train, jet_kv.rollout) == (jet.train, jet.rollout)
    # (its KV scales are powers of two: the decode kernel keeps them out of its dots, exactly)
    assert jet_kv.kv_cache("train") == jet_kv.kv_cache("rollout") == KVCacheSpec(pow2_scale=True)
    assert str(jet_kv.forward_graph("train")["kv_cache"]) == "e4m3/token-head/pow2"
    meta = jet_kv.metadata()
    assert meta["on_policy"] and meta["train_fp8_kv"] and meta["rollout_fp8_kv"] and not meta["declared_off_policy"]
    assert meta["kv_pow2_scale"] and not meta["pow2_scale"]  # the linears keep the paper's fp32 scales
    # fp8kv_rollout: BF16 linears in both phases, FP8 KV only in the rollout -> declared off-policy
    assert not (off.train.is_fp8 or off.rollout.is_fp8) and off.off_policy
    assert off.kv_cache("train") is None and off.kv_cache("rollout") == KVCacheSpec(pow2_scale=True)
    assert check_rollout_subgraph(off) == {"on_policy": False, "mismatched_ops": ["kv_cache"]}
    # the same flow without the declaration is refused by the check, and so by the FP8 transform
    undeclared = dataclasses.replace(off, name="kv_undeclared", off_policy=False)
    with pytest.raises(OffPolicyRecipeError, match=r"kv_undeclared.*kv_cache: train=bf16 rollout=e4m3/token-head/pow2"):
        check_rollout_subgraph(undeclared)
    with pytest.raises(OffPolicyRecipeError):
        convert_to_float8(_tiny_model(), undeclared)
    # +pow2 adds the linears; the KV cache keeps its pow2 spec on both sides
    pow2 = get_recipe("jet_kv", pow2_scale=True)
    assert pow2.name == "jet_kv+pow2" and pow2.kv_cache("train") == pow2.kv_cache("rollout") == KVCacheSpec(True)
    assert check_rollout_subgraph(pow2)["on_policy"] and pow2.metadata()["pow2_scale"]
    # fp32 KV scales in training with pow2 ones in the rollout is a mismatch (different codes)
    half = dataclasses.replace(jet_kv, name="kv_pow2_rollout", ops={**jet_kv.ops, "kv_cache": KVCacheSpec(False)},
                               rollout_ops=jet_kv.ops)
    with pytest.raises(OffPolicyRecipeError, match="kv_cache: train=e4m3/token-head rollout=e4m3/token-head/pow2"):
        check_rollout_subgraph(half)


def test_subgraph_check_raises_on_an_undeclared_mismatch():
    jet = get_recipe("jet")
    # the rollout uses power-of-two scales but training does not: different codes
    bad_rollout = LinearPrecision(QuantSpec((1, 128), pow2_scale=True), QuantSpec((128, 128), pow2_scale=True))
    bad = dataclasses.replace(jet, name="jet_bad", rollout=bad_rollout)
    with pytest.raises(OffPolicyRecipeError, match="jet_bad.*linear.input.*off_policy=True"):
        check_rollout_subgraph(bad)
    # a non-linear op computed differently in the rollout (an FP8 KV cache the trainer never sees)
    kv = dataclasses.replace(jet, name="kv_bad", rollout_ops={**jet.ops, "kv_cache": KVCacheSpec()})
    with pytest.raises(OffPolicyRecipeError, match="kv_cache: train=bf16 rollout=e4m3"):
        check_rollout_subgraph(kv)
    declared = dataclasses.replace(kv, off_policy=True)
    assert check_rollout_subgraph(declared)["mismatched_ops"] == ["kv_cache"]
    with pytest.raises(OffPolicyRecipeError):
        convert_to_float8(nn.Sequential(nn.Linear(128, 128)), bad)


def test_pow2_applies_to_both_sides():
    recipe = get_recipe("jet", pow2_scale=True)
    assert recipe.train.input.pow2_scale and recipe.rollout.input.pow2_scale and recipe.train.wgrad.pow2_scale
    assert check_rollout_subgraph(recipe)["on_policy"] and recipe.metadata()["pow2_scale"]


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: get_recipe("fp4"), "unknown recipe 'fp4'.*bf16"),
        (lambda: QuantSpec((1, 64)), "block"),
        (lambda: QuantSpec((1, 128), fmt="e5m2"), "e4m3"),
        (lambda: precision_phase("eval").__enter__(), "unknown precision phase"),
        (lambda: KVCacheSpec(fmt="e5m2"), "e4m3"),
        (lambda: KVCacheSpec(granularity="token"), "token-head"),
        (lambda: dataclasses.replace(get_recipe("jet"), ops={"kv_cache": "fp8"}), "kv_cache='fp8'.*KVCacheSpec"),
    ],
)
def test_invalid_config_is_actionable(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_convert_default_filter_keeps_embedding_lm_head_norms_high_precision():
    model = convert_to_float8(_tiny_model(), get_recipe("jet"))
    converted = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert "lm_head" not in converted and isinstance(model.lm_head, nn.Linear)
    assert {n.rsplit(".", 1)[-1] for n in converted} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                         "up_proj", "down_proj"}
    assert not isinstance(model.model.embed_tokens, Float8Linear)
    assert convert_to_float8(_tiny_model(), get_recipe("bf16")).lm_head.__class__ is nn.Linear
    check_model_precision(model, get_recipe("jet"))
    with pytest.raises(ValueError, match="converted with recipe 'jet'"):
        check_model_precision(model, get_recipe("jet", pow2_scale=True))


def test_convert_shares_parameters():
    model = _tiny_model()
    before = {n: p for n, p in model.named_parameters()}
    convert_to_float8(model, get_recipe("jet"))
    after = dict(model.named_parameters())
    assert before.keys() == after.keys() and all(before[n] is after[n] for n in before)


@pytest.mark.parametrize("pow2", [False, True])
def test_single_quantizer_proof_train_rollout_export_bit_identical(monkeypatch, pow2):
    """The FP8 operands of every GEMM are bit-identical in the training forward and the rollout
    forward, and the exported weights are exactly the codes both used."""
    recipe = get_recipe("jet", pow2_scale=pow2)
    model = convert_to_float8(_tiny_model(seed=1), recipe)
    calls: list[tuple[str, object, object]] = []
    real_gemm = linear_mod.fp8_gemm

    def spy(a, b, out_dtype, **kwargs):
        calls.append((a, b))
        return real_gemm(a, b, out_dtype, **kwargs)

    monkeypatch.setattr(linear_mod, "fp8_gemm", spy)
    ids = torch.randint(0, 96, (2, 37))
    model(ids).logsumexp(-1).sum().backward()  # training forward (+ backward)
    num_layers = len([m for m in model.modules() if isinstance(m, Float8Linear)])
    train_fwd = calls[:num_layers]  # forward GEMMs come first, in module order
    calls.clear()
    with torch.no_grad(), precision_phase("rollout"):
        model(ids)
    rollout_fwd = list(calls)
    assert len(train_fwd) == len(rollout_fwd) == num_layers
    for (a_t, b_t), (a_r, b_r) in zip(train_fwd, rollout_fwd):
        for t, r in ((a_t, a_r), (b_t, b_r)):
            assert torch.equal(_u8(t.codes), _u8(r.codes)) and torch.equal(_u8(t.scales), _u8(r.scales))
    exported = fp8_state_dict(model)
    names = [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]
    for name, (_, w_used) in zip(names, train_fwd):
        assert exported[f"{name}.weight"].dtype == torch.float8_e4m3fn
        assert torch.equal(_u8(exported[f"{name}.weight"]), _u8(w_used.codes))
        assert torch.equal(_u8(exported[f"{name}.weight_scale_inv"]), _u8(w_used.scales))
    assert exported["lm_head.weight"].dtype == torch.bfloat16
    assert exported["model.norm.weight"].dtype == torch.bfloat16
    assert fp8_quantization_config(recipe) == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]
    }


def test_rollout_logits_equal_training_forward_logits_under_jet_but_not_fp8_rollout():
    ids = torch.randint(0, 96, (2, 20))
    gaps = {}
    for name in ("bf16", "jet", "fp8_rollout", "jet_kv", "fp8kv_rollout"):
        model = convert_to_float8(_tiny_model(seed=2), get_recipe(name))
        with torch.no_grad():
            train = model(ids)
            with precision_phase("rollout"):
                rollout = model(ids)
        gaps[name] = (train - rollout).abs().max().item()
    assert gaps["bf16"] == 0.0 and gaps["jet"] == 0.0 and gaps["jet_kv"] == 0.0
    assert gaps["fp8_rollout"] > 1e-3
    assert gaps["fp8kv_rollout"] > 1e-3  # FP8 K/V in the rollout forward only (measured 4.4e-2)


def test_jet_forward_is_batch_invariant_on_cpu():
    """A sequence's FP8 logits do not depend on what it is batched with (fp64-accumulated emulated
    GEMMs and fp64 attention on CPU), so rollout and trainer quantize the same activations."""
    model = convert_to_float8(_tiny_model(seed=3), get_recipe("jet"))
    torch.manual_seed(0)
    batch = torch.randint(0, 96, (5, 29))
    with torch.no_grad():
        together = model(batch)
        alone = torch.cat([model(batch[i:i + 1, :17]) for i in range(5)])
    assert torch.equal(together[:, :17], alone)
