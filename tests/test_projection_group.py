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
from jetrl.fp8.quant import quantize, record_quantization
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
    # with autograd on, the inference path is not taken (training's stacked Function is CUDA-only: the next test)
    calls.clear()
    with precision_phase("train"):
        model(ids).sum().backward()
    assert not calls and model.model.layers[0].self_attn.q_proj.weight.grad is not None


def _train(model, ids):
    with precision_phase("train"), record_quantization() as log:
        logits = model(ids)
        logits.float().square().mean().backward()
    return logits.detach(), [name for name, _ in log]


def test_stacked_training_matches_separate_members():
    """In training the siblings are one autograd Function (CUDA; widened to the CPU here): the logits bit for bit,
    every gradient within the rounding of dX (one GEMM instead of a sum of rounded ones), one gradient
    quantization per group, and nothing held after the last member."""
    ids = torch.randint(0, CFG.vocab_size, (3, 9))
    separate, stacked = _model(), _model()
    for group in _groups(stacked).values():
        group.devices = ("cuda", "cpu")
    want, want_names = _train(separate, ids)
    got, got_names = _train(stacked, ids)
    assert torch.equal(got, want)
    for (name, p), q in zip(separate.named_parameters(), stacked.parameters()):
        assert float((q.grad - p.grad).norm() / p.grad.norm()) < 1e-2, name
    grads = [n for n in got_names if n.endswith(".grad_output")]
    assert len(grads) == 4 * CFG.num_hidden_layers  # qkv, o, gate_up, down (7 separate members)
    assert "model.layers.0.self_attn.{q_proj,k_proj,v_proj}.grad_output" in grads
    assert len([n for n in want_names if n.endswith(".grad_output")]) == 7 * CFG.num_hidden_layers
    # the inputs' quantizations are the separate members' ones, call for call
    assert [n for n in got_names if ".input" in n] == [n for n in want_names if ".input" in n]
    assert all(g._memo._value is None for g in _groups(stacked).values())
    # a second step after one update of both (the same step): the stacked weight and its W^T follow the new weights
    with torch.no_grad():
        for p, q in zip(separate.parameters(), stacked.parameters()):
            step = 0.01 * p.grad.sign()
            p.add_(step)
            q.add_(step)
            p.grad = q.grad = None
    want, _ = _train(separate, ids)
    got, _ = _train(stacked, ids)
    assert torch.equal(got, want)
    for (name, p), q in zip(separate.named_parameters(), stacked.parameters()):
        assert float((q.grad - p.grad).norm() / p.grad.norm()) < 1e-2, name


def test_stacked_training_edge_cases():
    """A member that calls again computes afresh (its weight may have changed); an unused member's weight gets no
    gradient, as when it runs alone; a converted model deep-copies (the trainer's KL reference model)."""
    import copy

    model = _model()
    for group in _groups(model).values():
        group.devices = ("cuda", "cpu")
    attn = model.model.layers[0].self_attn
    x = torch.randn(2, 5, CFG.hidden_size)
    with precision_phase("train"):
        first = attn.q_proj(x)
        with torch.no_grad():
            attn.q_proj.weight.mul_(2)
        second = attn.q_proj(x)
        assert not torch.equal(second, first)
        (attn.q_proj(x).square().sum() + attn.k_proj(x).sum()).backward()
    assert attn.q_proj.weight.grad is not None and attn.k_proj.weight.grad is not None
    assert attn.v_proj.weight.grad is None
    twin = copy.deepcopy(model)
    ids = torch.randint(0, CFG.vocab_size, (2, 5))
    with torch.no_grad():
        assert torch.equal(twin(ids), model(ids))


def test_stacked_training_falls_back_where_it_cannot_apply():
    """A frozen member, or a recipe whose gradient layouts differ, trains the members separately."""
    model = _model()
    group = model.model.layers[0].mlp.gate_proj.projection_group
    group.devices = ("cuda", "cpu")
    x = torch.randn(5, CFG.hidden_size)
    spec = group.members[0].precision()
    assert group.trains(x, spec)
    group.members[1].weight.requires_grad_(False)
    assert not group.trains(x, spec)
    group.members[1].weight.requires_grad_(True)
    assert not group.trains(torch.randn(5, CFG.hidden_size, device="meta"), spec)


def test_stacked_training_switch(monkeypatch):
    """JETRL_STACKED_TRAINING=0 trains the members separately; a bad value is an actionable error."""
    monkeypatch.setenv("JETRL_STACKED_TRAINING", "0")
    group = _model().model.layers[0].mlp.gate_proj.projection_group
    group.devices = ("cuda", "cpu")
    assert not group.trains(torch.randn(5, CFG.hidden_size), group.members[0].precision())
    monkeypatch.setenv("JETRL_STACKED_TRAINING", "off")
    with pytest.raises(ValueError, match="JETRL_STACKED_TRAINING='off' is not a valid choice"):
        _model()


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_stacked_training_on_cuda():
    """On CUDA the members train as one Function by default. Its gradients are FP8 gradients like the separate
    members' (each quantization of dY moves them by ~3%, SQNR 29 dB, so the two differ by that much), so both are
    held to the BF16 model's: the stacked ones no further from it than the separate ones."""
    ids = torch.randint(0, CFG.vocab_size, (4, 64), device="cuda")
    results = {}
    for arm in ("bf16", "separate", "stacked"):
        torch.manual_seed(0)
        model = convert_to_float8(CausalLM(CFG).to("cuda", torch.bfloat16), get_recipe("bf16" if arm == "bf16" else "jet"))
        if arm == "separate":
            for m in model.modules():
                if isinstance(m, Float8Linear):
                    m.projection_group = None
        logits, names = _train(model, ids)
        results[arm] = logits.float(), {n: p.grad.float() for n, p in model.named_parameters()}, names
    assert "model.layers.0.self_attn.{q_proj,k_proj,v_proj}.grad_output" in results["stacked"][2]
    assert not any("{" in n for n in results["separate"][2])
    ref_logits, ref_grads, _ = results["bf16"]

    def errors(arm):
        logits, grads, _ = results[arm]
        return (float((logits - ref_logits).norm() / ref_logits.norm()),
                {n: float((grads[n] - g).norm() / g.norm()) for n, g in ref_grads.items()})

    (sep_logits, sep), (stk_logits, stk) = errors("separate"), errors("stacked")
    assert stk_logits < 1.2 * sep_logits + 1e-3
    assert sum(stk.values()) < 1.1 * sum(sep.values()), (sum(stk.values()), sum(sep.values()))
    for name in ref_grads:
        assert stk[name] < 1.5 * sep[name] + 1e-2, (name, stk[name], sep[name])


def test_inference_mode_inputs_take_the_plain_path():
    """``torch.inference_mode`` tensors have no version counter: no reuse, no stacking, same logits."""
    model = _model()
    ids = torch.randint(0, CFG.vocab_size, (2, 5))
    with torch.no_grad(), precision_phase("rollout"):
        expected = model(ids)
    with torch.inference_mode(), precision_phase("rollout"):
        got = model(ids)
    assert torch.equal(got, expected)
