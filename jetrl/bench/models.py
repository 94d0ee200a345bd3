"""Random 8B-shaped models for the bench, switching their recipe in place, and their decode bytes.

Building: the model is constructed directly on the device in the target dtype (an 8B model
initialized on the host would take minutes of CPU time and 33 GB of fp32), with the model's
own init (normal(0, 0.02) weights, unit norms): random, never zero.

Switching recipes: ``convert_to_float8`` only swaps plain ``nn.Linear`` modules, so converting
a converted model again would keep the old recipe. :func:`set_recipe` first undoes the
transform -- every ``Float8Linear`` back to an ``nn.Linear`` holding the *same* Parameters,
every attention ``kv_quant`` and every BF16 sibling stack back to None -- then converts with the
new recipe. No weight is copied; FP8 weight caches and BF16 stacks die with their modules.

Decode bytes (the bytes floor of a decode step, sections d and e): one step over B rows reads

    every weight once             Float8Linear under an FP8 rollout: its codes + scales (1 B/elem);
                                  any other Linear, the norms, the lm_head: model dtype
    B rows of the embedding       a gather, not the table
    the valid KV of every row     (length + 1) positions x bytes per position (all layers, K and V,
                                  FP8 scales included), as the engine's cache stores them
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

import torch
from torch import nn

from jetrl.fp8 import Float8Linear, convert_to_float8, float8_modules, get_recipe
from jetrl.fp8.producer_quant import remove_producer_quant
from jetrl.models import CausalLM, ModelConfig
from jetrl.models.stacked_projections import remove_stacked_projections


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def random_model(config: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0) -> CausalLM:
    """A randomly initialized CausalLM built on ``device`` in ``dtype`` (no host init, no copy)."""
    torch.manual_seed(seed)
    with torch.device(device), default_dtype(dtype):
        return CausalLM(config)


def strip_precision(model: nn.Module) -> nn.Module:
    """Undo ``convert_to_float8`` in place: Float8Linear -> nn.Linear (same Parameters), no KV transform."""
    for fqn, module in float8_modules(model).items():
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        with torch.device("meta"):
            linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
        linear.weight, linear.bias = module.weight, module.bias
        setattr(parent, child, linear)
    for module in model.modules():
        if getattr(module, "kv_quant", None) is not None:
            module.kv_quant = None
    remove_stacked_projections(model)  # frees the BF16 copies; convert_to_float8 installs fresh stacks
    remove_producer_quant(model)
    return model


def set_recipe(model: nn.Module, name: str) -> nn.Module:
    """Put ``model`` (converted or not) under recipe ``name``, in place, sharing its parameters."""
    strip_precision(model)
    return convert_to_float8(model, get_recipe(name))


def decode_weight_bytes(model: nn.Module, batch: int) -> int:
    """Bytes of weights one decode step over ``batch`` rows reads (module docstring)."""
    total = 0
    for module in model.modules():
        if isinstance(module, Float8Linear) and module.recipe.rollout.is_fp8:
            q = module.quantized_weight()
            total += q.codes.nbytes + q.scales.nbytes + (module.bias.nbytes if module.bias is not None else 0)
        elif isinstance(module, nn.Embedding):
            total += batch * module.embedding_dim * module.weight.element_size()
        else:
            total += sum(p.nbytes for p in module.parameters(recurse=False))
    return total


def kv_bytes_per_position(cache: object) -> float:
    """Bytes one cached token position costs across all layers (K + V, FP8 scales included)."""
    return cache.nbytes / (cache.num_slots * cache.max_len)


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
