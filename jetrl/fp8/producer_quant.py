"""Quantize an FP8 linear layer's input in the kernel that produces it: RMSNorm -> q/k/v and gate/up,
SwiGLU -> down_proj.

Why: without autograd (the rollout, the old-logprob pass) each FP8 linear quantizes its input in a
kernel of its own: 4 per decoder layer, ~2.8 µs each at decode sizes on the H200, 11 µs of the ~247
a `jet_kv` layer takes per decode step (docs/benchmarks.md, section d). Three of those four inputs
come out of one of the model's fused kernels (the two RMSNorms, SwiGLU), which holds the values in
registers anyway. Written as FP8 codes and scales in the same pass, the separate kernel goes away.

Exactness: the producer runs the very kernel it runs without this hook, with a quantizing epilogue
switched on by a constexpr; the epilogue quantizes the *rounded* output y with the quantizer's own
Triton helpers (``_quantize_groups_epilogue`` in jetrl/fp8/kernels/quant_triton.py). So y is
unchanged and the codes and scales are ``quantize(y)``'s, bit for bit (tests/test_producer_quant.py).
They reach the consumer through its input memo (input_memo.py), where a fresh quantization of y
would have been kept: the consumer's lookup hits, and q/k/v (or gate/up) share it as before.

When: the model's producers have a slot, ``None`` in the pure model (``RMSNorm.output_quant``,
``MLP.act_quant``), which :func:`install_producer_quant` fills with a :class:`ProducerQuant` naming
the consumer. A call takes the fused path only if the consumer would quantize this input now:
no autograd (with autograd the layer's Function quantizes both layouts itself), the consumer FP8 in
the current phase with 1x128 input groups, a CUDA tensor with the Triton quantizer, and a width that is
a multiple of 128. Otherwise the producer runs as before and the consumer quantizes on its own.

Status: opt-in (``JETRL_PRODUCER_QUANT=1`` when the model is converted). On the H200 the logits of a
converted model were bit-identical with and without it (2026-11-30); its effect on the decode step
and its use inside the engine's CUDA graphs have not been measured on a GPU yet, so it stays off by
default until they are.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from jetrl.fp8.linear import Float8Linear, offer_quantized_input
from jetrl.fp8.quant import BLOCK, Float8Blocks, quant_backend, report_quantized
from jetrl.fp8.recipe import QuantSpec
from jetrl.overrides import env_choice

# (producer attribute path, its slot, consumer attribute path), relative to a decoder layer; HF names
PRODUCERS = (
    ("input_layernorm", "output_quant", "self_attn.q_proj"),
    ("post_attention_layernorm", "output_quant", "mlp.gate_proj"),
    ("mlp", "act_quant", "mlp.down_proj"),
)


class ProducerQuant:
    """The quantization a producer writes for ``consumer`` (module docstring). Not a module: no state."""

    def __init__(self, consumer: Float8Linear) -> None:
        self.consumer = consumer

    def input_spec(self, x: Tensor) -> QuantSpec | None:
        """The consumer's input spec if a producer output shaped like ``x`` should be quantized now, else None."""
        return self.consumer_spec() if self.fusable(x) else None

    def consumer_spec(self) -> QuantSpec | None:
        """The spec the consumer would quantize its input with right now, if it would (no autograd, FP8 phase)."""
        if torch.is_grad_enabled():
            return None  # the layer's autograd Function quantizes both of its layouts itself
        spec = self.consumer.precision()
        return spec.input if spec.is_fp8 and spec.input.block == (1, BLOCK) else None

    @staticmethod
    def fusable(x: Tensor) -> bool:
        """Whether the producer kernels can quantize an output like ``x``: CUDA, the Triton quantizer, whole
        128-groups, and a tensor the input memo serves (not an inference-mode tensor)."""
        return (x.is_cuda and not x.is_inference() and x.shape[-1] % BLOCK == 0
                and quant_backend(x.device) == "triton")

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor | None:
        """``rms_norm_triton(x, weight, eps)``, its quantization offered to the consumer; None if not now."""
        spec = self.input_spec(x)
        if spec is None:
            return None
        from jetrl.models.kernels.fused_triton import rms_norm_triton

        y, codes, scales = rms_norm_triton(x, weight, eps, quantize_pow2=spec.pow2_scale)
        return self._offer(y, spec, codes, scales)

    def silu_mul(self, gate: Tensor, up: Tensor) -> Tensor | None:
        """``silu_mul_triton(gate, up)``, its quantization offered to the consumer; None if not now."""
        spec = self.input_spec(gate)
        if spec is None:
            return None
        from jetrl.models.kernels.fused_triton import silu_mul_triton

        y, codes, scales = silu_mul_triton(gate, up, quantize_pow2=spec.pow2_scale)
        return self._offer(y, spec, codes, scales)

    def _offer(self, y: Tensor, spec: QuantSpec, codes: Tensor, scales: Tensor) -> Tensor:
        blocks = report_quantized(Float8Blocks(codes, scales, (1, BLOCK)), f"{self.consumer.fqn}.input")
        offer_quantized_input(y, spec, blocks)
        return y


def install_producer_quant(model: nn.Module, enabled: bool | None = None) -> int:
    """Fill the producer slots of every decoder layer whose consumer is a Float8Linear; returns how many.

    ``enabled`` None (what the FP8 transform passes) reads ``JETRL_PRODUCER_QUANT``: opt-in for now, only
    with ``=1`` (module docstring, "Status"). True installs regardless (the bench, tests).
    """
    if enabled is None:
        enabled = env_choice("JETRL_PRODUCER_QUANT", ("0", "1"), "1 = RMSNorm/SwiGLU kernels write their "
                             "consumers' FP8 input codes; 0 = linear layers quantize their own") == "1"
    if not enabled:
        return 0
    count = 0
    for layer in model.modules():
        for producer_path, slot, consumer_path in PRODUCERS:
            producer, consumer = _find(layer, producer_path), _find(layer, consumer_path)
            if producer is not None and hasattr(producer, slot) and isinstance(consumer, Float8Linear):
                setattr(producer, slot, ProducerQuant(consumer))
                count += 1
    return count


def remove_producer_quant(model: nn.Module) -> None:
    """Empty every producer slot (undoing :func:`install_producer_quant`)."""
    for module in model.modules():
        for _, slot, _ in PRODUCERS:
            if isinstance(getattr(module, slot, None), ProducerQuant):
                setattr(module, slot, None)


def _find(root: nn.Module, path: str) -> nn.Module | None:
    module = root
    for name in path.split("."):
        module = getattr(module, name, None)
        if not isinstance(module, nn.Module):
            return None
    return module
