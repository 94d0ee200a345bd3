"""The FP8 transform: swap ``nn.Linear`` modules for :class:`Float8Linear` under a filter.

The model code stays pure (it only knows ``nn.Linear``); precision is applied from outside,
like torchao's ``convert_to_float8_training``. The default filter keeps in high precision
what Jet-RL and DeepSeek-V3 keep there: the embedding, the lm_head and the norms (the last
two are not ``nn.Linear`` in our models, the lm_head is, so it is skipped by name), MoE
routers (``*.mlp.gate``), and any layer whose dims are not multiples of 16 (FP8 tensor
cores need 16-aligned dims; such layers are tiny and not worth padding).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from jetrl.fp8.linear import Float8Linear
from jetrl.fp8.recipe import Recipe, check_rollout_subgraph

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

    Under ``bf16`` nothing is swapped. The parameters are shared, not copied, so optimizer
    state built before or after the transform stays valid.
    """
    check_rollout_subgraph(recipe)
    if not (recipe.train.is_fp8 or recipe.rollout.is_fp8):
        return model
    targets = [(fqn, m) for fqn, m in model.named_modules() if fqn and type(m) is nn.Linear and module_filter(m, fqn)]
    for fqn, linear in targets:
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Float8Linear.from_float(linear, recipe, name=fqn))
    return model


def float8_modules(model: nn.Module) -> dict[str, Float8Linear]:
    return {fqn: m for fqn, m in model.named_modules() if isinstance(m, Float8Linear)}


def check_model_precision(model: nn.Module, recipe: Recipe) -> None:
    """Raise if a converted layer carries a recipe other than the run's (a mixed graph)."""
    check_rollout_subgraph(recipe)
    for fqn, module in float8_modules(model).items():
        if module.recipe != recipe:
            raise ValueError(
                f"{fqn} was converted with recipe {module.recipe.name!r} but the run uses {recipe.name!r}; "
                "convert the model once, with the run's recipe"
            )


def refresh_weight_caches(model: nn.Module) -> int:
    """Quantize every changed FP8 weight now (call after ``optimizer.step()``); returns how many layers.

    A weight whose version did not change is not quantized again: the cache is keyed by version.
    """
    modules = float8_modules(model)
    with torch.no_grad():
        for module in modules.values():
            module.quantized_weight()
    return len(modules)
