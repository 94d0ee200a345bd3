"""A frozen copy of an FP8 model that holds codes only: the KL reference of an FP8-trained run.

With ``beta > 0`` the trainer keeps the start policy as the KL reference. That copy never trains, and under ``jet``
/ ``jet_kv`` each of its FP8 layers reads its weight only as the codes q(W), the same ones the rollout and the
trainer read (convert.py ``reads_only_codes``). Its BF16 master would be dead weight: 2 bytes per parameter, 12.9
GiB at the 8B's 36 layers, on every data-parallel rank.

:func:`frozen_copy` fills the policy's caches, then deep-copies the policy with each such layer's weight mapped to a
placeholder of the same shape, dtype and device that stores one element (a zero broadcast by strides). The master
is never copied, not even for a moment, and the copy's cache holds a copy of the codes, re-keyed to the placeholder
(weight_cache.py ``rekey``). Every later read returns those codes, so the reference's logprobs are the very ones a
full copy would give (tests/test_trainer.py). The copy is frozen (``requires_grad_(False)``, no optimizer), and its
caches refuse to quantize again: a written or moved placeholder (``.to()`` materializes zeros) raises instead of
quantizing zeros. W^T and a CPU weight's memoized dequantization are not copied either.

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
    memo: dict[int, object] = {id(m.weight): nn.Parameter(
        torch.zeros((), dtype=m.weight.dtype, device=m.weight.device).expand(m.weight.shape), requires_grad=False)
        for m in modules.values()}
    # nor does it copy what a cache derives from the codes -- W^T and W_s^T (backward only), a CPU weight's memoized
    # dequantization -- which a reused policy may hold
    for m in modules.values():
        cache, group = m.weight_cache, m.projection_group
        derived = [cache._weight_t, getattr(cache._weight, "_memo", None), group and group._stacked_t]
        memo.update({id(x): None for x in derived if x is not None})
    frozen = copy.deepcopy(model, memo).requires_grad_(False)
    for fqn, module in modules.items():
        spec, original = module.recipe.train.weight, module.weight
        if not module.weight_cache.is_current(original, spec):
            raise RuntimeError(f"{fqn}: its FP8 codes are not current after a refresh")
        copied = frozen.get_submodule(fqn)
        cache = copied.weight_cache
        cache.rekey(copied.weight, spec)  # the copied codes are q(W) of the master it never copied
        cache.frozen = True  # a moved or written placeholder raises instead of quantizing zeros
        if cache._weight.codes.device.type == "cpu":
            cache._weight.memoize()  # its own memo (the policy's was not copied)
        if copied.projection_group is not None:
            copied.projection_group._stacked_t_key = None
    return frozen
