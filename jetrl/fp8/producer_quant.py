"""A linear layer's FP8 input, written by the kernel that produces it (rollout and other no-grad passes).

Why: without autograd, every :class:`~jetrl.fp8.linear.Float8Linear` quantizes its input in a launch of its
own -- four per layer and decode step (q/k/v's, o's, gate/up's and down's inputs; siblings share one). At
decode sizes each is a latency-bound ~2.5 µs kernel (docs/benchmarks.md, sections c and d). All four inputs
come out of a kernel that already holds the values in registers: the input RMSNorm (-> q/k/v), the decode
attention (-> o), the post-attention residual add + RMSNorm (-> gate/up) and SwiGLU (-> down). A
:class:`ProducerQuant` in the model's slot (``RMSNorm.output_quant``, ``Attention.output_quant``,
``MLP.act_quant``) asks that kernel to write the 1x128 codes and scales too, and hands them to the consumer
through the same memo siblings share (input_memo.py: keyed by the output tensor object and its version), so
the consumer's own quantization is a hit.

Exactness, checked by tests:

* the codes and scales are ``quantize(y)``'s, bit for bit: the epilogue is the quantizer's row function
  (``quantize_rows``) on the stored values y;
* y itself does not change. The norms and SwiGLU are one compiled binary whether or not they quantize (a
  runtime flag, jetrl/models/kernels/fused_triton.py), so the engine's decode and the trainer's forward --
  which never quantizes there, it needs both layouts (linear.py) -- compute the same y and stay one graph.
  The decode attention kernel (jetrl/engine/kernels/decode_attention_triton.py) runs in the engine only;
  its epilogue comes after the output is rounded and stored, and a head of D = 128 is one group, so the
  codes are ``quantize`` of exactly the output the kernel returns.

When: no autograd, on CUDA with the fused kernels and the Triton quantizer, the consumer FP8 in the current
phase with 1x128 input groups, and the width a multiple of 128 (the attention's slot is read only by a KV
cache's fused decode ``attend``). Anywhere else the slot asks for nothing and the consumer quantizes its
input itself, with the same result. Nothing is computed twice when the memo misses (a hook replaced the
tensor, say): the consumer just quantizes again. ``JETRL_PRODUCER_QUANT=0`` (read when the model is
converted) installs nothing.
"""

from __future__ import annotations

import torch
from torch import nn

from jetrl.fp8.linear import Float8Linear, share_input_quantization
from jetrl.fp8.quant import BLOCK, E4M3, Float8Blocks, quant_backend, record
from jetrl.overrides import env_choice

ENV = "JETRL_PRODUCER_QUANT"

# (producer, its slot, the consumer), as module paths from a decoder layer: the producer's output is the
# consumer's input (the first sibling called, whose name the quantization is recorded under)
PRODUCERS = (
    ("input_layernorm", "output_quant", "self_attn.q_proj"),
    ("self_attn", "output_quant", "self_attn.o_proj"),
    ("post_attention_layernorm", "output_quant", "mlp.gate_proj"),
    ("mlp", "act_quant", "mlp.down_proj"),
)


class ProducerQuant:
    """The slot object: buffers for the consumer's FP8 input, and their hand-over (module docstring)."""

    def __init__(self, consumer: Float8Linear) -> None:
        self.consumer = consumer

    def buffers(self, rows: int, cols: int, device: torch.device):  # -> jetrl.models.fused.QuantizedOutput | None
        from jetrl.models.fused import QuantizedOutput  # (jetrl.models.fused imports jetrl.fp8 at import time)

        consumer = self.consumer
        if (torch.is_grad_enabled() or device.type != "cuda" or cols != consumer.in_features or cols % BLOCK
                or quant_backend(device) != "triton"):
            return None
        spec = consumer.precision()
        if not spec.is_fp8 or tuple(spec.input.block) != (1, BLOCK):
            return None
        from jetrl.fp8.kernels.quant_triton import scale_buffer

        codes = torch.empty((rows, cols), dtype=E4M3, device=device)
        # column-major scales, as Float8Linear quantizes its input on CUDA (cuBLAS's layout for operand A)
        scales = scale_buffer(rows, cols // BLOCK, True, device)
        return QuantizedOutput(codes, scales, spec.input.pow2_scale)

    def publish(self, out: torch.Tensor, quantized) -> None:
        blocks = Float8Blocks(quantized.codes, quantized.scales, (1, BLOCK))
        record(f"{self.consumer.fqn}.input", blocks)
        share_input_quantization(out, self.consumer.precision().input, blocks)


def install_producer_quant(model: nn.Module) -> int:
    """Fill the producer slots of every decoder layer whose consumer is a Float8Linear (``PRODUCERS``); returns
    how many (none with ``JETRL_PRODUCER_QUANT=0``: the consumers quantize their inputs themselves)."""
    if env_choice(ENV, ("0", "1"), "1 = norms, decode attention and SwiGLU write their FP8 consumer's input "
                  "codes (no-grad, CUDA), 0 = each FP8 linear layer quantizes its input itself") == "0":
        return 0
    count = 0
    for layer in model.modules():
        for producer_path, slot, consumer_path in PRODUCERS:
            producer, consumer = _submodule(layer, producer_path), _submodule(layer, consumer_path)
            if producer is not None and hasattr(producer, slot) and type(consumer) is Float8Linear:
                setattr(producer, slot, ProducerQuant(consumer))
                count += 1
    return count


def remove_producer_quant(model: nn.Module) -> None:
    """Empty every producer slot (the consumers quantize their inputs themselves again)."""
    for module in model.modules():
        for _, slot, _ in PRODUCERS:
            if isinstance(getattr(module, slot, None), ProducerQuant):
                setattr(module, slot, None)


def _submodule(module: nn.Module, path: str) -> nn.Module | None:
    for name in path.split("."):
        module = getattr(module, name, None)
        if not isinstance(module, nn.Module):
            return None
    return module
