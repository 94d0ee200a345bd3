"""Producer-side input quantization (jetrl/fp8/producer_quant.py, opt-in with JETRL_PRODUCER_QUANT=1): the
RMSNorm and SwiGLU kernels write their FP8 consumer's input codes in the same pass.

Checked: under ``TRITON_INTERPRET=1`` the quantizing kernels return the same output bits as without
the epilogue, and codes and scales equal to ``quantize_reference`` of that output (bit for bit, both
scale kinds, both scale layouts, widths that pad the kernels' blocks); off unless asked; the transform
fills the slots of an FP8 model and ``strip`` empties them; the hook stays off wherever the consumer
would not quantize (CPU, autograd, a BF16 phase). On a GPU: logits of a converted model are
bit-identical with and without the hooks, and the hooks remove 3 of the 4 activation quantizations
of each layer.
"""

import os
import subprocess
import sys

import pytest
import torch

from jetrl.fp8 import convert_to_float8, get_recipe, precision_phase
from jetrl.fp8.producer_quant import ProducerQuant, install_producer_quant, remove_producer_quant
from jetrl.models import CausalLM, ModelConfig

SCRIPT = r"""
import torch
from jetrl.fp8.quant import quantize_reference
from jetrl.models.kernels.fused_triton import rms_norm_triton, silu_mul_triton

def same_layout(a, b):  # strides agree on every dim longer than 1 (a size-1 dim's stride is arbitrary)
    return all(sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride()) if n > 1)


torch.manual_seed(0)
checked = 0
for dtype in (torch.bfloat16, torch.float32):
    for pow2 in (False, True):
        for col_major in (False, True):
            for shape in [(5, 256), (3, 2, 384), (1, 1152)]:
                x = (torch.randn(shape) * 3).to(dtype)
                x.view(-1, shape[-1])[0, :128] = 0.0  # an all-zero group: the scale floor
                w = (1 + 0.1 * torch.randn(shape[-1])).to(dtype)
                y, codes, scales = rms_norm_triton(x, w, 1e-6, quantize_pow2=pow2, col_major_scales=col_major)
                assert torch.equal(y, rms_norm_triton(x, w, 1e-6)), shape
                ref_codes, ref_scales = quantize_reference(y.reshape(-1, shape[-1]), 1, 128, pow2,
                                                           col_major_scales=col_major)
                assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8)), (dtype, pow2, shape)
                assert torch.equal(scales, ref_scales) and same_layout(scales, ref_scales), (dtype, pow2, shape)
                g, u = (torch.randn(shape) * 4).to(dtype), torch.randn(shape).to(dtype)
                y, codes, scales = silu_mul_triton(g, u, quantize_pow2=pow2, col_major_scales=col_major)
                assert torch.equal(y, silu_mul_triton(g, u)), shape
                ref_codes, ref_scales = quantize_reference(y.reshape(-1, shape[-1]), 1, 128, pow2,
                                                           col_major_scales=col_major)
                assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8)), (dtype, pow2, shape)
                assert torch.equal(scales, ref_scales) and same_layout(scales, ref_scales)
                checked += 1
print("OK", checked)
"""


def test_quantizing_kernels_match_the_quantizer_in_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.startswith("OK 24"), proc.stdout + proc.stderr[-3000:]


def _tiny(device="cpu", dtype=torch.float32) -> CausalLM:
    cfg = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=128, qk_norm=True,
                      architecture="Qwen3ForCausalLM")
    torch.manual_seed(0)
    return CausalLM(cfg).to(device, dtype)


@pytest.fixture
def producer_quant_on(monkeypatch):
    monkeypatch.setenv("JETRL_PRODUCER_QUANT", "1")  # opt-in (producer_quant.py, "Status")


def test_off_unless_asked(monkeypatch):
    monkeypatch.delenv("JETRL_PRODUCER_QUANT", raising=False)
    layer = convert_to_float8(_tiny(), get_recipe("jet")).model.layers[0]
    assert layer.input_layernorm.output_quant is None and layer.mlp.act_quant is None
    monkeypatch.setenv("JETRL_PRODUCER_QUANT", "yes")
    with pytest.raises(ValueError, match="JETRL_PRODUCER_QUANT='yes'"):
        convert_to_float8(_tiny(), get_recipe("jet"))


def test_transform_fills_the_producer_slots_and_strip_empties_them(producer_quant_on):
    model = convert_to_float8(_tiny(), get_recipe("jet"))
    layer = model.model.layers[0]
    assert isinstance(layer.input_layernorm.output_quant, ProducerQuant)
    assert layer.input_layernorm.output_quant.consumer is layer.self_attn.q_proj
    assert layer.post_attention_layernorm.output_quant.consumer is layer.mlp.gate_proj
    assert layer.mlp.act_quant.consumer is layer.mlp.down_proj
    assert layer.self_attn.q_norm.output_quant is None  # feeds RoPE, not a linear
    assert install_producer_quant(model) == 3 * 2  # idempotent: the same slots again
    remove_producer_quant(model)
    assert all(getattr(m, "output_quant", None) is None and getattr(m, "act_quant", None) is None
               for m in model.modules())
    bf16 = convert_to_float8(_tiny(), get_recipe("bf16"))
    assert bf16.model.layers[0].input_layernorm.output_quant is None  # nothing is FP8


def test_hook_is_off_where_the_consumer_would_not_quantize(producer_quant_on):
    model = convert_to_float8(_tiny(), get_recipe("fp8_rollout"))  # BF16 training, FP8 rollout
    hook = model.model.layers[0].input_layernorm.output_quant
    with torch.no_grad(), precision_phase("rollout"):
        assert hook.consumer_spec() == model.model.layers[0].self_attn.q_proj.precision().input
        assert hook.input_spec(torch.randn(3, 256)) is None  # CPU: the consumer quantizes with the reference
    with torch.no_grad(), precision_phase("train"):
        assert hook.consumer_spec() is None  # the BF16 training phase: nothing to quantize
    with precision_phase("rollout"):
        assert hook.consumer_spec() is None  # autograd on: the layer's Function quantizes both layouts
    assert not ProducerQuant.fusable(torch.randn(3, 256))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_producer_quant_is_exact_and_removes_kernels_on_cuda(producer_quant_on):
    from torch.profiler import ProfilerActivity, profile

    for recipe in ("jet", "jet_kv"):
        model = convert_to_float8(_tiny("cuda", torch.bfloat16), get_recipe(recipe))
        ids = torch.randint(0, 512, (4, 33), device="cuda")
        with torch.no_grad(), precision_phase("rollout"):
            model(ids)  # quantizes the weights into their caches, which the counts below must not see
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fused = model(ids)
                torch.cuda.synchronize()
            quant_fused = _kernels(prof, "_quantize_kernel")
            remove_producer_quant(model)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                plain = model(ids)
                torch.cuda.synchronize()
            quant_plain = _kernels(prof, "_quantize_kernel")
        assert torch.equal(fused, plain), recipe
        # per layer, 3 of the 4 activation quantizations (q/k/v, gate/up, down; not o) move into the producers
        assert quant_plain - quant_fused == 3 * 2, (recipe, quant_plain, quant_fused)


def _kernels(prof, name: str) -> int:
    return sum(e.device_type == torch.autograd.DeviceType.CUDA and e.name.startswith(name) for e in prof.events())
