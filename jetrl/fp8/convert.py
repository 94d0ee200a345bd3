"""The FP8 transform: swap ``nn.Linear`` modules for :class:`Float8Linear` under a filter.

The model code stays pure (it only knows ``nn.Linear``); precision is applied from outside,
like torchao's ``convert_to_float8_training``. The default filter keeps in high precision
what Jet-RL and DeepSeek-V3 keep there: the embedding, the lm_head and the norms (the last
two are not ``nn.Linear`` in our models, the lm_head is, so it is skipped by name), MoE
routers (``*.mlp.gate``), and any layer whose dims are not multiples of 16 (FP8 tensor
cores need 16-aligned dims; such layers are tiny and not worth padding).

A recipe with an FP8 KV cache in either phase (``jet_kv``, ``fp8kv_rollout``) also gets one
:class:`~jetrl.fp8.kv_quant.KVQuant` per attention layer, set as ``Attention.kv_quant``: the
model's KV hook then quantizes->dequantizes K/V wherever the recipe says so (kv_quant.py). This
happens even when no linear layer is FP8 (``fp8kv_rollout``). :func:`model_recipe` reads the
recipe back from a converted model; the engine uses it to pick its KV cache format.

Speedups are installed with the linear layers: projection groups (FP8 q/k/v and gate/up as one
stacked GEMM on CUDA, and in training as one autograd Function, projection_group.py) and, for
inference only, producer-side input quantization (the norms, the decode attention and SwiGLU write
their FP8 consumer's input codes, producer_quant.py) and, for every recipe, ``bf16`` included, the
BF16 q/k/v and gate/up stacks (jetrl/models/stacked_projections.py), which take over wherever those
siblings stay BF16.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from jetrl.fp8.kv_quant import KVQuant
from jetrl.fp8.linear import Float8Linear
from jetrl.fp8.producer_quant import install_producer_quant
from jetrl.fp8.projection_group import install_projection_groups
from jetrl.fp8.recipe import Recipe, check_rollout_subgraph
from jetrl.fp8.weight_cache import batched_finite_check
from jetrl.fp8.weight_shard import weight_gathers
from jetrl.models.stacked_projections import install_stacked_projections, refresh_stacked_projections

ModuleFilter = Callable[[nn.Module, str], bool]
_SKIP_NAMES = ("lm_head", "embed", "norm", "mlp.gate", "router")


def default_module_filter(module: nn.Module, fqn: str) -> bool:
    """True if ``module`` (at path ``fqn``) should become a Float8Linear."""
    if not isinstance(module, nn.Linear):
        return False
    leaf = fqn.rsplit(".", 1)[-1]
    if any(fqn.endswith(s) or leaf.startswith(s) for s in _SKIP_NAMES):
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def convert_to_float8(model: nn.Module, recipe: Recipe, module_filter: ModuleFilter = default_module_filter) -> nn.Module:
    """Swap the filtered ``nn.Linear`` modules of ``model`` in place; return ``model``.

    Under ``bf16`` no module is swapped. The parameters are shared, not copied, so optimizer
    state built before or after the transform stays valid. FP8 KV recipes also install the
    KV transform on every attention layer (module docstring), whatever the filter says.
    """
    check_rollout_subgraph(recipe)
    install_stacked_projections(model)  # BF16 q/k/v, gate/up without autograd on CUDA: one GEMM each (not for FP8)
    if recipe.quantizes_kv:
        install_kv_quant(model, recipe)
    if not (recipe.train.is_fp8 or recipe.rollout.is_fp8):
        return model
    targets = [(fqn, m) for fqn, m in model.named_modules() if fqn and type(m) is nn.Linear and module_filter(m, fqn)]
    for fqn, linear in targets:
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Float8Linear.from_float(linear, recipe, name=fqn))
    install_projection_groups(model)  # q/k/v and gate/up: one stacked GEMM (rollout) or Function (training) on CUDA
    install_producer_quant(model)  # the producers of FP8 inputs write their codes (no-grad, CUDA)
    return model


def install_kv_quant(model: nn.Module, recipe: Recipe) -> int:
    """Set ``kv_quant`` on every attention layer (the modules with a ``kv_quant`` slot); returns how many."""
    layers = [m for m in model.modules() if hasattr(m, "kv_quant") and hasattr(m, "layer_idx")]
    if not layers:
        raise ValueError(
            f"recipe {recipe.name!r} quantizes K/V but {type(model).__name__} has no attention layer with a "
            "KV hook (a module with `kv_quant` and `layer_idx`, like jetrl.models.llama.Attention)"
        )
    for attn in layers:
        attn.kv_quant = KVQuant(recipe, attn.layer_idx)
    return len(layers)


def float8_modules(model: nn.Module) -> dict[str, Float8Linear]:
    return {fqn: m for fqn, m in model.named_modules() if isinstance(m, Float8Linear)}


def reads_only_codes(module: Float8Linear) -> bool:
    """Whether every pass of ``module`` reads its weight as the FP8 codes of one spec (training and rollout alike,
    ``jet`` and ``jet_kv``): its BF16 master then serves only the optimizer and the quantizer."""
    train = module.recipe.train.weight
    return train is not None and module.recipe.rollout.weight == train


def kv_quant_modules(model: nn.Module) -> dict[str, KVQuant]:
    """Attention fqn -> its installed KV transform."""
    return {fqn: m.kv_quant for fqn, m in model.named_modules() if isinstance(getattr(m, "kv_quant", None), KVQuant)}


def model_recipe(model: nn.Module) -> Recipe | None:
    """The recipe ``model`` was converted with (from its Float8Linear layers and KV transforms);
    None for an unconverted model (or one converted under ``bf16``, which changes nothing)."""
    recipes = {m.recipe for m in float8_modules(model).values()} | {t.recipe for t in kv_quant_modules(model).values()}
    if len(recipes) > 1:
        names = sorted(r.name for r in recipes)
        raise ValueError(f"the model mixes recipes {names} across its layers; convert it once, with one recipe")
    if not recipes:
        return None
    recipe = recipes.pop()
    if recipe.quantizes_kv and not kv_quant_modules(model):
        raise ValueError(
            f"the model's linear layers carry recipe {recipe.name!r}, which quantizes K/V, but no attention "
            "layer has its KV transform; convert with jetrl.fp8.convert_to_float8 (it installs both)"
        )
    return recipe


def check_model_precision(model: nn.Module, recipe: Recipe) -> None:
    """Raise if a converted layer or KV transform carries a recipe other than the run's (a mixed graph)."""
    check_rollout_subgraph(recipe)
    for fqn, module in float8_modules(model).items():
        if module.recipe != recipe:
            raise ValueError(
                f"{fqn} was converted with recipe {module.recipe.name!r} but the run uses {recipe.name!r}; "
                "convert the model once, with the run's recipe"
            )
    transforms = kv_quant_modules(model)
    for fqn, transform in transforms.items():
        if transform.recipe != recipe:
            raise ValueError(
                f"{fqn}.kv_quant was installed with recipe {transform.recipe.name!r} but the run uses "
                f"{recipe.name!r}; convert the model once, with the run's recipe"
            )
    if recipe.quantizes_kv and not transforms:
        raise ValueError(
            f"recipe {recipe.name!r} quantizes K/V but the model has no KV transform; convert it with "
            "jetrl.fp8.convert_to_float8(model, recipe)"
        )


def refresh_weight_caches(model: nn.Module) -> int:
    """Quantize every changed FP8 weight now (call after ``optimizer.step()``); returns how many layers.

    A weight whose version did not change is not quantized again: the cache is keyed by version.
    With sharded weights (jetrl/fp8/weight_shard.py) this is a collective: every rank calls it together.
    The BF16 sibling stacks (jetrl/models/stacked_projections.py) are brought up to date the same way.
    """
    modules = float8_modules(model)
    # one device sync for every weight's finiteness check; sharded weights gather their codes (weight_shard.py: every
    # rank refreshes together)
    with torch.no_grad(), batched_finite_check(), weight_gathers():
        for module in modules.values():
            module.quantized_weight()
        refresh_stacked_projections(model)
    return len(modules)
