"""A frozen copy of an FP8 model that holds codes only: the KL reference of an FP8-trained run.

With ``beta > 0`` the trainer keeps the start policy as the KL reference. That copy never trains, and under ``jet``
/ ``jet_kv`` each of its FP8 layers reads its weight only as the codes q(W), the same ones the rollout and the
trainer read (convert.py ``reads_only_codes``). Its BF16 master would be dead weight: 2 bytes per parameter, 12.9
GiB at the 8B's 36 layers, on every data-parallel rank.

:func:`frozen_copy` fills the policy's caches, then deep-copies the policy with each such layer's weight mapped to a
placeholder of the same shape, dtype and device that stores one element (a zero broadcast by strides). The master
is never copied, not even for a moment, and the copy's cache holds a copy of the codes, re-keyed to the placeholder
(weight_cache.py ``rekey``). Every later read returns those codes, so the reference's logprobs are the very ones a
full copy would give (tests/test_trainer.py). Nothing may write to the placeholder: a write would bump its version
and re-quantize zeros. The copy is therefore frozen (``requires_grad_(False)``) and holds no optimizer.

Layers that read their BF16 weight keep a copy of it: ``bf16``, ``fp8_rollout`` and ``fp8kv_rollout``, which all
train in BF16.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from jetrl.fp8.convert import float8_modules, reads_only_codes, refresh_weight_caches


def frozen_copy(model: nn.Module) -> nn.Module:
    """A frozen deep copy of ``model`` whose code-only FP8 layers hold their codes and no master (module docstring)."""
    modules = {fqn: m for fqn, m in float8_modules(model).items() if reads_only_codes(m)}
    if modules:
        refresh_weight_caches(model)  # the codes the copy takes
    memo = {id(m.weight): nn.Parameter(torch.zeros((), dtype=m.weight.dtype, device=m.weight.device)
                                       .expand(m.weight.shape), requires_grad=False) for m in modules.values()}
    frozen = copy.deepcopy(model, memo).requires_grad_(False)
    for fqn, module in modules.items():
        spec, original = module.recipe.train.weight, module.weight
        if not module.weight_cache.is_current(original, spec):
            raise RuntimeError(f"{fqn}: its FP8 codes are not current after a refresh")
        copied = frozen.get_submodule(fqn)
        copied.weight_cache.rekey(copied.weight, spec)  # the copied codes are q(W) of the master it never copied
    return frozen
