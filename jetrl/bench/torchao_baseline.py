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
``jetrl bench --sections b --torchao`` turns it on. Section (b) took 191 s with it in run AY (torchao autotunes its
quantization kernels per shape; the parts were not timed separately), hence off by default.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from jetrl.bench.checks import sqnr_db
from jetrl.bench.timing import time_ms

OFF = "torchao baseline off (--torchao)"


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
        why = f"{type(exc).__name__}: {str(exc)[:120]}"
        return None, f"torchao {torchao.__version__} Float8BlockwiseLinear failed ({why})"


def torchao_fields(bf16: nn.Linear, x: torch.Tensor, dy: torch.Tensor, ref: dict[str, torch.Tensor],
                   timer: dict[str, Any]) -> dict[str, Any]:
    """The fwd+bwd row's torchao fields: ``torchao`` (its version, or why there is no figure), and when it ran
    ``torchao_ms`` (fwd+bwd, timed as the row's others with ``timer``) and ``torchao_sqnr_db`` (y, dx, dw against
    ``ref``, the fp32 layer's). A failure anywhere in torchao is recorded here, never raised: the jetrl and BF16
    figures of the row stand on their own."""
    ao, version = torchao_linear(bf16)
    if ao is None:
        return {"torchao": version}
    try:
        xa = x.clone().requires_grad_()
        ya = ao(xa)
        ya.backward(dy)
        sqnr = {"y": sqnr_db(ya, ref["y"]), "dx": sqnr_db(xa.grad, ref["dx"]), "dw": sqnr_db(ao.weight.grad, ref["dw"])}
        del xa, ya

        def fwd_bwd() -> None:
            ao.weight.grad = None
            xa = x.detach().requires_grad_()
            ao(xa).backward(dy)

        ms = time_ms(fwd_bwd, **timer)
    except Exception as exc:  # noqa: BLE001 -- optional baseline
        return {"torchao": f"{version} failed ({type(exc).__name__}: {str(exc)[:120]})"}
    finally:
        ao.weight.grad = None  # the weight is bf16's own Parameter
    return {"torchao": version, "torchao_ms": ms, "torchao_sqnr_db": sqnr}
