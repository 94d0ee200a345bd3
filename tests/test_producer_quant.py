"""Producer-side input quantization (jetrl/fp8/producer_quant.py): the slots the FP8 transform fills, and the
hand-over of a producer's codes to the consumer. The kernels' codes are checked against the quantizer in
tests/test_fused_ops.py (interpreter), and on the GPU below and in tests/test_engine_graphs.py."""

import pytest
import torch
from torch import nn

from jetrl.fp8 import Float8Linear, convert_to_float8, get_recipe, precision_phase, quantize
from jetrl.fp8.linear import share_input_quantization
from jetrl.fp8.producer_quant import ProducerQuant, install_producer_quant, remove_producer_quant
from jetrl.models import CausalLM, ModelConfig

CFG = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, qk_norm=True, architecture="Qwen3ForCausalLM")


def test_fp8_recipes_fill_the_producer_slots_and_bf16_does_not():
    model = convert_to_float8(CausalLM(CFG), get_recipe("jet"))
    for layer in model.model.layers:
        assert layer.input_layernorm.output_quant.consumer is layer.self_attn.q_proj
        assert layer.self_attn.output_quant.consumer is layer.self_attn.o_proj
        assert layer.post_attention_layernorm.output_quant.consumer is layer.mlp.gate_proj
        assert layer.mlp.act_quant.consumer is layer.mlp.down_proj
    assert model.model.norm.output_quant is None  # the final norm feeds the BF16 lm_head
    remove_producer_quant(model)
    assert all(getattr(m, s, None) is None for m in model.modules() for s in ("output_quant", "act_quant"))
    assert install_producer_quant(model) == 4 * CFG.num_hidden_layers
    bf16 = convert_to_float8(CausalLM(CFG), get_recipe("bf16"))
    assert all(getattr(m, s, None) is None for m in bf16.modules() for s in ("output_quant", "act_quant"))


def test_slots_ask_for_nothing_off_cuda_and_under_autograd():
    fp8 = Float8Linear.from_float(nn.Linear(256, 128), get_recipe("jet"), name="proj")
    with torch.no_grad():
        assert ProducerQuant(fp8).buffers(4, 256, torch.device("cpu")) is None  # the CPU: the consumer quantizes


def test_consumer_reads_the_handed_over_codes():
    fp8 = Float8Linear.from_float(nn.Linear(256, 128), get_recipe("jet"), name="proj")
    y, other = torch.randn(4, 256), torch.randn(4, 256) * 3
    spec = fp8.precision().input
    with torch.no_grad(), precision_phase("rollout"):
        expected = fp8(other)
        share_input_quantization(y, spec, quantize(other, spec.block, pow2_scale=spec.pow2_scale))
        assert torch.equal(fp8(y), expected)  # a hit: the codes handed over, not y's own
        assert not torch.equal(fp8(y.clone()), expected)  # another tensor object: its own quantization
    share_input_quantization(y, spec, quantize(other, spec.block))
    with torch.enable_grad():
        assert not torch.equal(fp8(y), expected)  # training quantizes both layouts itself


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_decode_with_producer_codes_equals_the_consumers_own():
    """On the GPU: the model's no-grad forward with the slots filled gives the same logits, bit for bit, as with
    them emptied (the consumers quantizing themselves), and the norms' outputs are the trainer's."""
    from jetrl.fp8 import record_quantization

    torch.manual_seed(0)
    model = convert_to_float8(CausalLM(CFG).to("cuda", torch.bfloat16), get_recipe("jet"))
    ids = torch.randint(0, 512, (5, 33), device="cuda")
    with torch.no_grad(), precision_phase("rollout"):
        model(ids)  # quantizes the weights once, so that the recorded passes below hold only activations
    with torch.no_grad(), precision_phase("rollout"), record_quantization() as with_slots:
        fused = model(ids)
    remove_producer_quant(model)
    with torch.no_grad(), precision_phase("rollout"), record_quantization() as own:
        plain = model(ids)
    assert torch.equal(fused, plain)
    assert [n for n, _ in with_slots] == [n for n, _ in own] and len(own) == 4 * CFG.num_hidden_layers
    for (_, a), (_, b) in zip(with_slots, own):
        assert torch.equal(a.codes.view(torch.uint8), b.codes.view(torch.uint8)) and torch.equal(a.scales, b.scales)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 61, 256, 9216])
def test_kernels_quantizing_or_not_compute_the_same_output(rows):
    """The property that keeps the rollout a subgraph of training: the trainer's norms and SwiGLU (autograd, no
    epilogue) and the engine's (epilogue on) give the same bits; and the codes are quantize()'s."""
    from jetrl.fp8.producer_quant import ProducerQuant
    from jetrl.models.fused import _FusedAddRMSNorm, _FusedRMSNorm, _FusedSiluMul
    from jetrl.models.kernels.fused_triton import add_rms_norm_triton, rms_norm_triton, silu_mul_triton

    torch.manual_seed(rows)
    dev = torch.device("cuda")
    x, d = (torch.randn(rows, 4096, device=dev) * 3).bfloat16(), torch.randn(rows, 4096, device=dev).bfloat16()
    w = (1 + 0.1 * torch.randn(4096, device=dev)).bfloat16()
    g, u = (torch.randn(rows, 12288, device=dev) * 3).bfloat16(), torch.randn(rows, 12288, device=dev).bfloat16()
    slot = ProducerQuant(Float8Linear.from_float(nn.Linear(4096, 64), get_recipe("jet"), name="n"))
    slot_mlp = ProducerQuant(Float8Linear.from_float(nn.Linear(12288, 64), get_recipe("jet"), name="d"))
    with torch.no_grad():
        qa, qb, qc = slot.buffers(rows, 4096, dev), slot.buffers(rows, 4096, dev), slot_mlp.buffers(rows, 12288, dev)
        engine = (rms_norm_triton(x, w, 1e-6, qa), add_rms_norm_triton(x, d, w, 1e-6, qb)[1], silu_mul_triton(g, u, qc))
    trainer = (_FusedRMSNorm.apply(x.requires_grad_(), w, 1e-6), _FusedAddRMSNorm.apply(x, d, w, 1e-6)[1],
               _FusedSiluMul.apply(g.requires_grad_(), u))
    for a, b, q in zip(engine, trainer, (qa, qb, qc)):
        assert torch.equal(a.view(torch.int16), b.detach().view(torch.int16))
        ref = quantize(a, (1, 128))
        assert torch.equal(q.codes.view(torch.uint8), ref.codes.view(torch.uint8))
        assert torch.equal(q.scales.view(torch.int32), ref.scales.view(torch.int32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("recipe", ["jet", "jet_kv"])
def test_engine_decode_with_producer_codes_equals_the_consumers_own(recipe, monkeypatch):
    """On the GPU, through the engine's CUDA-graph decode: with the slots filled (the decode attention kernel
    writes o_proj's FP8 input in its epilogue, head_dim 128) the sampled tokens and logprobs are bit for bit
    those of the consumers quantizing their inputs themselves."""
    from jetrl.engine import Engine, SamplingParams

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, qk_norm=True, architecture="Qwen3ForCausalLM")
    model = convert_to_float8(CausalLM(cfg).to("cuda", torch.bfloat16), get_recipe(recipe))
    prompts = [torch.randint(0, 512, (n,)).tolist() for n in (5, 17, 33, 9, 60)]
    params = SamplingParams(n=3, temperature=1.0, max_tokens=24, seed=0)

    def no_fallback(*args, **kwargs):
        raise AssertionError("head_dim 128: the kernel's epilogue, not a separate quantize, writes o_proj's input")

    with monkeypatch.context() as patch:
        patch.setattr("jetrl.engine.decode_attention.quantize", no_fallback)
        fused = Engine(model, max_slots=16, max_len=128).generate(prompts, params)
    assert model.model.layers[0].self_attn.output_quant is not None
    remove_producer_quant(model)
    plain = Engine(model, max_slots=16, max_len=128).generate(prompts, params)
    for a, b in zip(fused, plain):
        for x, y in zip(a, b):
            assert x.token_ids == y.token_ids and x.logprobs == y.logprobs


class _CPUSlot(ProducerQuant):
    """The attention's slot with the CUDA condition lifted, so that the CPU runs the hand-over."""

    def buffers(self, rows, cols, device):
        from jetrl.models.fused import QuantizedOutput

        with torch.device(device):
            return QuantizedOutput(torch.empty(rows, cols, dtype=torch.float8_e4m3fn), torch.empty(rows, cols // 128),
                                   self.consumer.precision().input.pow2_scale)


@pytest.mark.parametrize("recipe", ["jet", "jet_kv"])
def test_attention_hands_its_codes_to_o_proj(monkeypatch, recipe):
    """The attention's slot, wired on the CPU: a cache's fused ``attend`` (a stand-in for the GPU kernel) writes
    o_proj's FP8 input and the model publishes it on the very tensor o_proj reads. With quantize(out) the engine's
    output is the one of o_proj quantizing itself, bit for bit; with other codes it is not, so o_proj read them."""
    from jetrl.engine import Engine, SamplingParams
    from jetrl.engine.decode_attention import decode_attention_reference, quantize_output
    from jetrl.models.fused import QuantizedOutput

    written = []

    def attend(q, k, v, lengths, *, quantized=None, pow2_scales=False, row_order=None, **kw):
        out = decode_attention_reference(q, k, v, lengths, **kw)
        if quantized is not None:
            codes, scales, pow2 = quantized
            quantize_output(out * scale_codes_by, QuantizedOutput(codes, scales, pow2))
            written.append(codes.shape)
        return out

    monkeypatch.setattr("jetrl.engine.decode_attention.decode_attention", attend)
    cfg = ModelConfig(vocab_size=512, hidden_size=512, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)  # head_dim 128
    torch.manual_seed(0)
    model = convert_to_float8(CausalLM(cfg), get_recipe(recipe))
    prompts = [torch.randint(0, 512, (n,)).tolist() for n in (3, 9, 5)]
    params = SamplingParams(n=2, temperature=0, max_tokens=6)

    def run(slot: bool):
        for layer in model.model.layers:
            layer.self_attn.output_quant = _CPUSlot(layer.self_attn.o_proj) if slot else None
        engine = Engine(model, max_slots=6, max_len=24)
        engine.cache.use_decode_kernel = True  # the fused decode path, as on CUDA
        return [[(c.token_ids, c.logprobs) for c in group] for group in engine.generate(prompts, params)]

    scale_codes_by = 1.0
    own = run(slot=False)
    assert not written
    assert run(slot=True) == own and written  # the handed-over codes, equal to o_proj's own
    scale_codes_by = 2.0
    assert run(slot=True) != own  # other codes: o_proj read what the attention wrote
