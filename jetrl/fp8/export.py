"""FP8 export tensors, read from the quantize-once cache.

The fine-grained FP8 checkpoint format that vLLM, SGLang and transformers read stores, per
quantized linear layer, ``<name>.weight`` in F8_E4M3 and ``<name>.weight_scale_inv`` in
fp32 with one entry per 128x128 block, where ``weight ~= weight * weight_scale_inv``
blockwise. Our dequant scale is exactly that multiplier, so export is a read of each
layer's :class:`~jetrl.fp8.weight_cache.WeightCache`: the file holds the very codes the
trainer's forward and the rollout used, not a re-quantization. Everything else (embeddings,
lm_head, norms, biases) is written in BF16.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from jetrl.fp8.convert import float8_modules
from jetrl.fp8.quant import BLOCK
from jetrl.fp8.recipe import Recipe


def fp8_state_dict(model: nn.Module, hp_dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """State dict in the fine-grained FP8 layout (CPU tensors); raises if no layer is FP8."""
    modules = {fqn: m for fqn, m in float8_modules(model).items() if m.quantized_weight() is not None}
    if not modules:
        raise ValueError("fp8_state_dict: the model has no FP8 linear layers; convert it with an FP8 recipe first")
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        fqn = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and fqn in modules:
            q = modules[fqn].quantized_weight()
            out[name] = q.codes.detach().cpu().contiguous()
            out[f"{fqn}.weight_scale_inv"] = q.scales.detach().cpu().contiguous()
        else:
            out[name] = tensor.detach().to(hp_dtype).cpu()
    return out


def high_precision_linears(model: nn.Module) -> list[str]:
    """Names of the ``nn.Linear`` modules an FP8 export keeps in BF16 (its ``modules_to_not_convert``).

    Loaders (transformers' FineGrainedFP8 quantizer, vLLM's ``Fp8Config``) swap every other
    ``nn.Linear`` for an FP8 one and expect ``weight_scale_inv`` next to its weight. With an
    explicit list transformers adds no default skips, so ``lm_head`` is listed here too.
    """
    fp8 = {fqn for fqn, m in float8_modules(model).items() if m.quantized_weight() is not None}
    return [fqn for fqn, m in model.named_modules() if isinstance(m, nn.Linear) and fqn not in fp8]


def fp8_quantization_config(recipe: Recipe, modules_to_not_convert: list[str] | None = None) -> dict:
    """The ``quantization_config`` entry of config.json for an FP8 export."""
    spec = recipe.rollout.weight or recipe.train.weight
    if spec is None:
        raise ValueError(f"recipe {recipe.name!r} has no FP8 weights to export; export as bf16")
    config = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK],
    }
    if modules_to_not_convert:
        config["modules_to_not_convert"] = list(modules_to_not_convert)
        config["ignored_layers"] = list(modules_to_not_convert)  # vLLM before it read modules_to_not_convert too
    return config
