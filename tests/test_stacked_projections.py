"""The BF16 sibling stacks (jetrl/models/stacked_projections.py): one GEMM per group without autograd, fresh
after every write.

It runs on CUDA only; these tests widen it to the CPU (``devices=("cpu",)``) to check its logic, and
tests/test_engine_graphs.py checks it on the GPU inside the engine's CUDA graphs.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from jetrl import fp8
from jetrl.models import CausalLM
from jetrl.models.stacked_projections import (
    StackedProjections,
    install_stacked_projections,
    refresh_stacked_projections,
    stacked_bytes,
)
from jetrl.models.tiny import tiny_model_config

from .conftest import requires_cuda


def _model(bias: bool = False, seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    return CausalLM(dataclasses.replace(tiny_model_config(), attention_bias=bias))


SIBLINGS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))


def _count_sibling_calls(model: CausalLM) -> list[int]:
    calls = [0]
    for layer in model.model.layers:
        for parent, names in SIBLINGS:
            for name in names:
                getattr(getattr(layer, parent), name).register_forward_hook(
                    lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("bias", [False, True])
def test_stacked_forward_equals_three_projections(bias):
    model = _model(bias)
    ids = torch.randint(0, model.config.vocab_size, (3, 11))
    with torch.no_grad():
        expected = model(ids)
    assert install_stacked_projections(model, devices=("cpu",)) == 2 * model.config.num_hidden_layers
    calls = _count_sibling_calls(model)
    with torch.no_grad():
        got = model(ids)
    assert calls[0] == 0, "the stacked path should replace the sibling modules"
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    model(ids).sum().backward()  # autograd: the separate modules, each with its own backward
    assert calls[0] == 5 * model.config.num_hidden_layers
    assert all(p.grad is not None for layer in model.model.layers for p in layer.self_attn.q_proj.parameters())


def test_stack_follows_weight_updates_in_place():
    model = _model()
    install_stacked_projections(model, devices=("cpu",))
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    with torch.no_grad():
        model(ids)
    attn = model.model.layers[0].self_attn
    buffer = attn.qkv_stack.weight
    address = buffer.data_ptr()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(ids).square().mean().backward()
    opt.step()
    (stacked,) = {w.data_ptr() for w in refresh_stacked_projections(model)[:1]}
    assert stacked == address, "refreshed in place: a CUDA graph holding the buffer reads the new weights"
    q, k, v = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
    assert torch.equal(attn.qkv_stack.weight, torch.cat([q, k, v]).detach())
    with torch.no_grad():  # a write that bypasses the version counter needs invalidate()
        q.data.add_(1.0)
    refresh_stacked_projections(model)
    assert not torch.equal(attn.qkv_stack.weight[: q.shape[0]], q.detach())
    attn.qkv_stack.invalidate()
    refresh_stacked_projections(model)
    assert torch.equal(attn.qkv_stack.weight[: q.shape[0]], q.detach())


def test_fused_optimizer_steps_reach_the_stack_when_tracked():
    model = _model()
    install_stacked_projections(model, devices=("cpu",))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    fp8.track_optimizer(opt)
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    model(ids).square().mean().backward()
    opt.step()
    fp8.refresh_weight_caches(model)
    attn = model.model.layers[1].self_attn
    assert torch.equal(attn.qkv_stack.weight,
                       torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach())
    mlp = model.model.layers[1].mlp
    assert torch.equal(mlp.gate_up_stack.weight, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach())


def test_convert_installs_the_stack_for_every_recipe_and_fp8_members_keep_their_own_path():
    bf16 = fp8.convert_to_float8(_model(), fp8.get_recipe("bf16"))
    assert all(isinstance(layer.self_attn.qkv_stack, StackedProjections)
               and isinstance(layer.mlp.gate_up_stack, StackedProjections) for layer in bf16.model.layers)
    jet = fp8.convert_to_float8(_model(), fp8.get_recipe("jet"))
    attn = jet.model.layers[0].self_attn
    assert attn.qkv_stack.members(attn) is None  # q/k/v are Float8Linear: their projection group applies
    ids = torch.randint(0, jet.config.vocab_size, (2, 5))
    with torch.no_grad():
        jet(ids)
    assert attn.qkv_stack.weight is None and jet.model.layers[0].mlp.gate_up_stack.weight is None, \
        "no BF16 copy is made for FP8 members"


def test_cpu_default_never_stacks():
    model = fp8.convert_to_float8(_model(), fp8.get_recipe("bf16"))
    calls = _count_sibling_calls(model)
    with torch.no_grad():
        model(torch.randint(0, model.config.vocab_size, (2, 5)))
    assert calls[0] == 5 * model.config.num_hidden_layers  # the CPU keeps its bit-exact separate GEMMs
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_stack.weight is None and layer.mlp.gate_up_stack.weight is None


@requires_cuda
def test_cuda_bf16_model_stacks_and_matches_three_gemms():
    model = _model().to("cuda", torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (4, 9), device="cuda")
    with torch.no_grad():
        expected = model(ids).float()
    fp8.convert_to_float8(model, fp8.get_recipe("bf16"))
    calls = _count_sibling_calls(model)
    with torch.no_grad():
        got = model(ids).float()
    assert calls[0] == 0 and model.model.layers[0].mlp.gate_up_stack.weight.is_cuda
    assert (got - expected).abs().max().item() <= 0.05 * expected.abs().max().item()


def test_switch_off_installs_no_stack_and_a_bad_value_is_named(monkeypatch):
    monkeypatch.setenv("JETRL_BF16_STACKS", "0")
    model = fp8.convert_to_float8(_model(), fp8.get_recipe("bf16"))
    assert model.model.layers[0].self_attn.qkv_stack is None and model.model.layers[0].mlp.gate_up_stack is None
    monkeypatch.setenv("JETRL_BF16_STACKS", "yes")
    with pytest.raises(ValueError, match="JETRL_BF16_STACKS='yes' is not a valid choice"):
        install_stacked_projections(_model())


def test_out_of_memory_advice_names_the_stacks_when_they_hold_memory():
    from jetrl.rl.config import GRPOConfig
    from jetrl.rl.memory import advice

    model = _model()
    install_stacked_projections(model, devices=("cpu",))
    assert stacked_bytes(model) == 0
    with torch.no_grad():
        model(torch.randint(0, model.config.vocab_size, (1, 4)))
    layer = model.model.layers[0]
    per_layer = sum(m.weight.numel() for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                                               layer.mlp.gate_proj, layer.mlp.up_proj)) * 4  # fp32
    assert stacked_bytes(model) == per_layer * model.config.num_hidden_layers
    args = GRPOConfig(per_device_train_batch_size=2, gradient_accumulation_steps=1, generation_batch_size=4,
                      num_generations=2)
    assert "JETRL_BF16_STACKS=0" in advice("update", args, stacked_bytes(model))
    assert "JETRL_BF16_STACKS" not in advice("rollout", args, 0)
    assert "grpo.train_cuda_graphs='off'" in advice("rollout", args, 0, train_graphs=True)
    assert "train_cuda_graphs" not in advice("rollout", args, 0)
