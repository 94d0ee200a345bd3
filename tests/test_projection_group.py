"""Sibling projections (q/k/v, gate/up) as one stacked FP8 GEMM (jetrl/fp8/projection_group.py).

The stacked path runs only on CUDA without autograd; here on CPU it is forced on (``applies``
patched) to check its logic against the separate GEMMs it replaces: the stacked codes and scales are
the members' own, bit for bit (128x128 blocks stack exactly), the members' weight-cache entries are
views of the stacked buffer (zero copy) that later versions are written into in place, a primed
(replaced) entry is re-pointed, and the model's rollout logits match the ungrouped model's.
"""

import pytest
import torch

from jetrl.fp8 import convert_to_float8, get_recipe, precision_phase
from jetrl.fp8.linear import Float8Linear
from jetrl.fp8.projection_group import ProjectionGroup, install_projection_groups
from jetrl.fp8.quant import quantize
from jetrl.models import CausalLM, ModelConfig

CFG = ModelConfig(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, qk_norm=True, architecture="Qwen3ForCausalLM")


def _model(recipe="jet"):
    torch.manual_seed(0)
    return convert_to_float8(CausalLM(CFG), get_recipe(recipe))


def _groups(model):
    return {id(m.projection_group): m.projection_group for m in model.modules()
            if isinstance(m, Float8Linear) and m.projection_group is not None}


def _bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def test_groups_are_installed_for_fp8_siblings_only():
    model = _model()
    groups = _groups(model)
    assert len(groups) == 2 * CFG.num_hidden_layers  # q/k/v and gate/up per layer
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.projection_group is attn.k_proj.projection_group is attn.v_proj.projection_group
    assert attn.o_proj.projection_group is None and model.model.layers[0].mlp.down_proj.projection_group is None
    assert not _groups(_model("bf16"))  # nothing is converted under bf16
    odd = CausalLM(ModelConfig(**{**CFG.__dict__, "head_dim": 48}))  # k/v N = 96: not whole 128-row blocks
    assert install_projection_groups(convert_to_float8(odd, get_recipe("jet"))) == 2  # gate/up only


def test_stacked_weight_is_the_members_codes_with_zero_copy():
    model = _model()
    attn = model.model.layers[1].self_attn
    group, spec = attn.q_proj.projection_group, get_recipe("jet").rollout.weight
    stacked = group.stacked_weight(spec)
    for member, start in zip(group.members, group.offsets):
        own = quantize(member.weight.detach(), (128, 128))
        rows = slice(start, start + member.out_features)
        assert torch.equal(_bits(stacked.codes[rows]), _bits(own.codes))
        assert torch.equal(stacked.scales[start // 128:(start + member.out_features) // 128], own.scales)
        entry = member.weight_cache.get(member.weight, spec)
        assert entry.codes.data_ptr() == stacked.codes[rows].data_ptr()  # a view, not a copy
    # a new version of one member (an optimizer step) lands in the same stacked buffer
    before = stacked.codes.data_ptr()
    with torch.no_grad():
        attn.k_proj.weight.mul_(1.5).add_(0.01)
    again = group.stacked_weight(spec)
    k_rows = slice(group.offsets[1], group.offsets[1] + attn.k_proj.out_features)
    assert again.codes.data_ptr() == before
    assert torch.equal(_bits(again.codes[k_rows]), _bits(quantize(attn.k_proj.weight.detach(), (128, 128)).codes))
    # an entry replaced behind the group's back (a primed checkpoint) is copied back and re-pointed
    primed = quantize(attn.v_proj.weight.detach() * 0.5, (128, 128))
    attn.v_proj.weight_cache.prime(attn.v_proj.weight, spec, primed)
    third = group.stacked_weight(spec)
    v_rows = slice(group.offsets[2], group.offsets[2] + attn.v_proj.out_features)
    assert torch.equal(_bits(third.codes[v_rows]), _bits(primed.codes))
    assert attn.v_proj.weight_cache.get(attn.v_proj.weight, spec).codes.data_ptr() == third.codes[v_rows].data_ptr()


def test_stacked_path_gives_the_separate_gemms_logits(monkeypatch):
    model = _model()
    ids = torch.randint(0, CFG.vocab_size, (3, 9))
    with torch.no_grad(), precision_phase("rollout"):
        separate = model(ids)
        calls = []
        original = ProjectionGroup.output

        def spy(self, member, x, spec, quantize_input):
            calls.append(member.fqn)
            return original(self, member, x, spec, quantize_input)

        monkeypatch.setattr(ProjectionGroup, "applies", lambda self, x, spec: not torch.is_grad_enabled())
        monkeypatch.setattr(ProjectionGroup, "output", spy)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        stacked = model(ids)
    assert len(calls) == 5 * CFG.num_hidden_layers
    assert all(g._memo._value is None for g in _groups(model).values())  # nothing held after the last member
    torch.testing.assert_close(stacked, separate, rtol=1e-5, atol=1e-5)
    # with autograd on, members run their own GEMMs (each has its own backward)
    calls.clear()
    with precision_phase("train"):
        model(ids).sum().backward()
    assert not calls and model.model.layers[0].self_attn.q_proj.weight.grad is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_stacked_path_on_cuda():
    torch.manual_seed(0)
    model = convert_to_float8(CausalLM(CFG).to("cuda", torch.bfloat16), get_recipe("jet"))
    ids = torch.randint(0, CFG.vocab_size, (4, 7), device="cuda")
    with torch.no_grad(), precision_phase("rollout"):
        stacked = model(ids).float()
        q_proj = model.model.layers[0].self_attn.q_proj
        group = q_proj.projection_group
        assert q_proj.quantized_weight().codes.data_ptr() == group.stacked_weight(q_proj.precision().weight).codes.data_ptr()
        for m in model.modules():
            if isinstance(m, Float8Linear):
                m.projection_group = None
        separate = model(ids).float()
    assert float((stacked - separate).norm() / separate.norm()) < 1e-2


def test_inference_mode_inputs_take_the_plain_path():
    """``torch.inference_mode`` tensors have no version counter: no reuse, no stacking, same logits."""
    model = _model()
    ids = torch.randint(0, CFG.vocab_size, (2, 5))
    with torch.no_grad(), precision_phase("rollout"):
        expected = model(ids)
    with torch.inference_mode(), precision_phase("rollout"):
        got = model(ids)
    assert torch.equal(got, expected)
