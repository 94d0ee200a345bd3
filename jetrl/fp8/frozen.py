"""A frozen FP8 model holds codes only: the KL reference of an FP8-trained run.

With ``beta > 0`` the trainer keeps the start policy as the KL reference (a deep copy). That copy never trains, and
under ``jet`` / ``jet_kv`` each of its FP8 layers reads its weight only as the codes q(W), the same ones the
rollout and the trainer read (convert.py ``reads_only_codes``). Once those codes are cached, the layer's BF16
master is dead weight: 2 bytes per parameter, 16 GB at 8B, on every data-parallel rank.

:func:`drop_fp8_masters` quantizes every such layer and then replaces its weight with a placeholder of the same
shape, dtype and device that stores one element (a zero broadcast by strides). The cache is re-keyed to the
placeholder (weight_cache.py ``rekey``), so every later read returns the cached codes: the reference's logprobs
are the very ones the full copy would give. Nothing writes to the placeholder. A write would bump its version and
re-quantize zeros, so the reference is kept out of the optimizer and out of ``requires_grad``.

Layers that read their BF16 weight (``bf16``, ``fp8_rollout``, ``fp8kv_rollout``: BF16 training) keep it.
"""

from __future__ import annotations

import torch
from torch import nn

from jetrl.fp8.convert import float8_modules, reads_only_codes, refresh_weight_caches


def drop_fp8_masters(model: nn.Module) -> int:
    """Keep only the FP8 codes of every layer of ``model`` that reads nothing else (module docstring); returns how
    many layers. ``model`` must be frozen (no parameter requires grad)."""
    if any(p.requires_grad for p in model.parameters()):
        raise ValueError("drop_fp8_masters needs a frozen model (requires_grad_(False)): a trained weight must keep "
                         "its BF16 master")
    modules = [m for m in float8_modules(model).values() if reads_only_codes(m)]
    refresh_weight_caches(model)  # the codes, and each projection group's stacked buffer, from the masters
    for module in modules:
        spec, full = module.recipe.train.weight, module.weight
        if not module.weight_cache.is_current(full, spec):
            raise RuntimeError(f"{module.fqn}: its FP8 codes are not current after a refresh")
        placeholder = torch.zeros((), dtype=full.dtype, device=full.device).expand(full.shape)
        module.weight = nn.Parameter(placeholder, requires_grad=False)
        module.weight_cache.rekey(module.weight, spec)
    return len(modules)
