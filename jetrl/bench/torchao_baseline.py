"""The optional second baseline of section (b): torchao's blockwise FP8 training linear.

Why this baseline: ``torchao.prototype.blockwise_fp8_training.Float8BlockwiseLinear`` implements the
same recipe as ``jet`` -- E4M3, 1x128 groups for x and dy (dy and x both grouped along tokens for
wgrad), 128x128 blocks for the weight, FP8 GEMMs in fprop, dgrad and wgrad through
``F.scaled_mm`` -- so it is the like-for-like answer to "is jetrl's FP8 linear fast". Two
differences, both in its disfavour and both what it ships: it quantizes the weight (both layouts)
on every call where jetrl quantizes once per optimizer step, and it saves x in BF16 and
re-quantizes it in backward.

torchao is optional: imported lazily, and when it is missing or cannot build the module (no SM90,
a torch it does not support) the row records why instead of a figure. On the H200 the wheel
travels with the work tree (``pip download --no-deps torchao``; PYTHONPATH to the unzipped wheel), and
``jetrl bench --sections b --torchao`` turns the row on (section (b) took 191 s with it in run AY, mostly torchao's Triton autotuning).
"""

from __future__ import annotations

from torch import nn


def torchao_linear(bf16: nn.Linear) -> tuple[nn.Module | None, str]:
    """``(module, version)`` of torchao's blockwise FP8 linear sharing ``bf16``'s weight, or ``(None, why)``."""
    try:
        import torchao
        from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinear
    except Exception as exc:  # noqa: BLE001 -- optional baseline: any import failure is recorded, not raised
        return None, f"torchao unavailable ({type(exc).__name__}: {str(exc)[:120]})"
    try:
        return Float8BlockwiseLinear.from_float(bf16), f"torchao {torchao.__version__}"
    except Exception as exc:  # noqa: BLE001
        return None, f"torchao {torchao.__version__} Float8BlockwiseLinear failed ({type(exc).__name__}: {str(exc)[:120]})"
