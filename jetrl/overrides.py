"""How a fast path's backend is chosen, one mechanism for all of them: the quantizer
(``JETRL_QUANT_BACKEND``), the FP8 GEMM (``JETRL_GEMM_BACKEND``, ``jetrl.fp8.override_backend``), the
decode attention (``JETRL_DECODE_ATTENTION``, ``use_decode_attention_backend``), the fused
RMSNorm/RoPE/SwiGLU and chosen-token logprob kernels (``JETRL_FUSED_OPS``, ``use_fused_ops``) and the fused
sampler (``JETRL_FUSED_SAMPLER``, ``use_fused_sampler``); and switches that are not backends: exact mode
(``JETRL_EXACT``, jetrl/exact.py), the BF16 sibling stacks (``JETRL_BF16_STACKS``, models/stacked_projections.py),
sibling projections trained as one Function (``JETRL_STACKED_TRAINING``, fp8/projection_group.py), the producers'
FP8 epilogues (``JETRL_PRODUCER_QUANT``, fp8/producer_quant.py), the weight refresh's CUDA graph
(``JETRL_REFRESH_GRAPH``, fp8/refresh_graph.py), programmatic dependent launch of the decode GEMMs (``JETRL_PDL``,
``use_pdl``, fp8/kernels/pdl.py) and the quantizers' software rounding (``JETRL_QUANT_EXPLICIT_ROUND``,
fp8/kernels/quant_triton.py). The README's "Environment switches" lists them with their values.

* :func:`env_choice` reads a backend's environment variable and rejects a value it does not know
  with one actionable message, naming the variable and the choices.
* :class:`ScopedOverride` forces a choice for a block of code: each fast path resolves its default
  once (per device, from the hardware and the variable); tests and benchmarks must force another
  one and get the previous one back afterwards, also when blocks nest or raise.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any


def env_choice(var: str, choices: tuple[str, ...], meaning: str = "") -> str | None:
    """The value of environment variable ``var`` if set (None if not), checked against ``choices``.

    ``meaning`` explains the choices in the error, e.g. ``"1 = fused kernels, 0 = PyTorch ops"``.
    """
    value = os.environ.get(var)
    if value is not None and value not in choices:
        raise ValueError(f"{var}={value!r} is not a valid choice; use one of {', '.join(choices)}"
                         + (f" ({meaning})" if meaning else "") + f", or unset {var} for the default")
    return value


class ScopedOverride:
    """``with override(choice):`` forces ``choice`` inside the block; ``override.value`` is the
    innermost forced choice, or None outside every block."""

    def __init__(self, what: str, choices: tuple[Any, ...]) -> None:
        self.what, self.choices = what, choices
        self._stack: list[Any] = []

    @property
    def value(self) -> Any:
        return self._stack[-1] if self._stack else None

    @contextlib.contextmanager
    def __call__(self, choice: Any) -> Iterator[None]:
        if choice not in self.choices:
            raise ValueError(f"unknown {self.what} {choice!r}; use one of {self.choices}")
        self._stack.append(choice)
        try:
            yield
        finally:
            self._stack.pop()
