"""Quantize each weight once per parameter version.

Every reader of an FP8 weight (the training forward, the rollout engine, the FP8 export)
goes through one :class:`WeightCache` per linear layer, so they all see the very same codes
and scales, and a weight is quantized once per optimizer step instead of once per forward.

Key: ``(param._version, param.data_ptr(), spec)``. PyTorch bumps ``_version`` on every
in-place write through the parameter (``optimizer.step()``, ``load_state_dict``,
``copy_`` under ``no_grad``), so a stale entry cannot be read after an update. Writes that
bypass the version counter (``param.data.copy_(...)``) must call :meth:`invalidate` or
:func:`jetrl.fp8.refresh_weight_caches`, which the trainer calls after each optimizer step
to fill every cache eagerly (off the rollout's critical path).

dgrad needs W^T. It is derived from the cached codes (:meth:`Float8Blocks.t`), never
re-quantized from BF16, so fprop and dgrad use one set of weight codes.

Weights are always quantized with ``check_finite=True``: a NaN/Inf weight raises a
:class:`~jetrl.fp8.quant.NonFiniteError` naming the parameter instead of entering FP8.
"""

from __future__ import annotations

import torch

from jetrl.fp8.quant import Float8Blocks, quantize
from jetrl.fp8.recipe import QuantSpec


class WeightCache:
    """The FP8 codes of one weight (and its transpose), valid for one parameter version."""

    def __init__(self, name: str = "weight") -> None:
        self.name = name
        self.num_quantizations = 0  # how many times this weight was quantized (tests, metrics)
        self._key: tuple | None = None
        self._weight: Float8Blocks | None = None
        self._weight_t: Float8Blocks | None = None

    def get(self, weight: torch.Tensor, spec: QuantSpec) -> Float8Blocks:
        """q(W) in ``spec``'s blocks, quantized only if ``weight`` changed since the last call."""
        key = (weight._version, weight.data_ptr(), weight.device, spec)
        if key != self._key:
            with torch.no_grad():
                self._weight = quantize(
                    weight.detach(), spec.block, pow2_scale=spec.pow2_scale, check_finite=True, name=self.name
                )
            self._weight_t = None
            self._key = key
            self.num_quantizations += 1
        return self._weight

    def get_transposed(self, weight: torch.Tensor, spec: QuantSpec) -> Float8Blocks:
        """q(W)^T for dgrad, from the same codes as :meth:`get`."""
        quantized = self.get(weight, spec)
        if self._weight_t is None:
            self._weight_t = quantized.t()
        return self._weight_t

    def invalidate(self) -> None:
        self._key = self._weight = self._weight_t = None
