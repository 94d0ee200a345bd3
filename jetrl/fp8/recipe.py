"""Precision recipes as data, and the check that keeps a run on-policy.

A recipe says, for each kind of op, how it is computed in the trainer's forward, in the
trainer's backward and in the rollout. The trainer and the engine are handed the same
``Recipe`` and call the same quantizer, so a recipe *is* the precision flow.

| recipe            | trainer fwd / bwd                    | rollout                              | on-policy |
|-------------------|--------------------------------------|--------------------------------------|-----------|
| ``bf16``          | BF16                                 | BF16                                 | yes       |
| ``fp8_rollout``   | BF16                                 | FP8 block linears (re-quantized W)   | no: the baseline verl/slime/NeMo-RL ship |
| ``jet``           | FP8 fprop + dgrad + wgrad            | FP8 linears, same quantizer, same W codes | yes (Jet-RL) |
| ``jet_kv``        | ``jet`` + FP8 K/V (quantize->dequantize, straight-through backward) | ``jet`` + FP8 KV cache, same quantizer | yes |
| ``fp8kv_rollout`` | BF16 (K/V in BF16)                   | BF16 linears + FP8 KV cache          | no: the FP8-KV baseline (NeMo-RL style) |

Jet-RL's condition is that the rollout's quantized graph is a subgraph of the training
forward graph: every op the rollout runs is computed the same way in the trainer's forward.
:func:`check_rollout_subgraph` compares the two forward graphs op by op (format, block,
scale rule) and raises unless they agree; a recipe may differ only if it *declares* itself
off-policy (``off_policy=True``), which then shows in :meth:`Recipe.metadata`.

Ops other than linear layers (embedding, lm_head, norms, attention, the KV cache) appear in
the graph too, as ``"bf16"`` or as a spec, so the KV cache is checked by the same function.
The KV-cache entry is either ``"bf16"`` or a :class:`KVCacheSpec`: E4M3 codes with one fp32
scale per token per KV head (the ``head_dim`` vector is the group), computed dynamically when
K/V are written (after k-norm and RoPE), by the same :func:`~jetrl.fp8.quant.quantize`. In the
trainer that is a quantize->dequantize of K and V at the model's KV hook; in the engine it is
the FP8 cache (``jetrl/fp8/kv_quant.py`` has the math). ``jet_kv`` puts the spec in both
phases, so its rollout is still a subgraph of training; ``fp8kv_rollout`` only in the rollout,
so it must (and does) declare itself off-policy.

The KV cache's scales are powers of two in every recipe that has one (``e4m3/token-head/pow2``,
in the trainer and the rollout alike): dequantization ``codes * 2^k`` is then exact, so the decode
kernel keeps the scales out of its tensor-core dots with no rounding difference from the trainer's
fake quantization (engine/kernels/decode_attention_triton.py), which makes FP8 decode attention
~1.4x faster than with fp32 scales on the H200 (docs/benchmarks.md, section d). The price is in
the codes: the group's amax maps into (224, 448] instead of onto 448, i.e. up to one binade less
headroom above E4M3's subnormals (measured SQNR: 31.5 vs 31.8 dB on Gaussian K/V, 31.5 vs 33.9 dB
on heavy-tailed K/V). A :class:`KVCacheSpec` with ``pow2_scale=False`` still works everywhere
(trainer, cache, exact in-loop dequantization in the kernel) for a custom recipe.

``pow2_scale`` (the ``+pow2`` recipes) switches the linear layers' operands to power-of-two scales
too, on both sides (the codes differ from fp32-scale codes, so the two phases must agree, and the
check enforces it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Literal

from jetrl.fp8.quant import BLOCK

Phase = Literal["train", "rollout"]
PHASES: tuple[Phase, ...] = ("train", "rollout")
NON_LINEAR_OPS = ("embedding", "lm_head", "norm", "attention", "kv_cache")


class OffPolicyRecipeError(ValueError):
    """The rollout would compute some op differently from the trainer's forward."""


@dataclass(frozen=True)
class QuantSpec:
    """How one GEMM operand is quantized: E4M3, a block shape, fp32 or power-of-two scales."""

    block: tuple[int, int]
    pow2_scale: bool = False
    fmt: str = "e4m3"

    def __post_init__(self) -> None:
        if self.fmt != "e4m3":
            raise ValueError(f"QuantSpec.fmt={self.fmt!r}: only 'e4m3' is implemented")
        if self.block not in ((1, BLOCK), (BLOCK, BLOCK)):
            raise ValueError(
                f"QuantSpec.block={self.block}: use (1, {BLOCK}) for activations/gradients or "
                f"({BLOCK}, {BLOCK}) for weights"
            )


@dataclass(frozen=True)
class KVCacheSpec:
    """An FP8 KV cache: E4M3 codes, one fp32 (or power-of-two) scale per token per KV head.

    The group is the ``head_dim`` vector of one token in one KV head, i.e. block
    ``(1, head_dim)`` over K/V reshaped to ``(-1, head_dim)``; the block is not stored here
    because it follows from the model. ``str()`` gives the recipe-table form ``e4m3/token-head``.
    """

    pow2_scale: bool = False
    fmt: str = "e4m3"
    granularity: str = "token-head"

    def __post_init__(self) -> None:
        if self.fmt != "e4m3":
            raise ValueError(f"KVCacheSpec.fmt={self.fmt!r}: only 'e4m3' is implemented")
        if self.granularity != "token-head":
            raise ValueError(
                f"KVCacheSpec.granularity={self.granularity!r}: only 'token-head' (one scale per token per "
                "KV head) is implemented"
            )

    def __str__(self) -> str:
        return f"{self.fmt}/{self.granularity}" + ("/pow2" if self.pow2_scale else "")


@dataclass(frozen=True)
class LinearPrecision:
    """The operands of a linear layer's GEMMs. ``None`` means that GEMM runs in high precision.

    input:       X in fprop, 1x128 along K.
    weight:      W in fprop (and W^T in dgrad, from the same codes), 128x128.
    grad_output: dY in dgrad, 1x128 along N.
    wgrad:       dY^T and X^T in wgrad, 1x128 along tokens (M).
    """

    input: QuantSpec | None
    weight: QuantSpec | None
    grad_output: QuantSpec | None = None
    wgrad: QuantSpec | None = None

    def __post_init__(self) -> None:
        if (self.input is None) != (self.weight is None):
            raise ValueError("LinearPrecision: quantize both input and weight for an FP8 fprop, or neither")
        if (self.grad_output is None) != (self.wgrad is None) or (self.grad_output and self.input is None):
            raise ValueError("LinearPrecision: FP8 dgrad and wgrad come together, and need an FP8 fprop")

    @property
    def is_fp8(self) -> bool:
        return self.weight is not None

    def forward_only(self) -> LinearPrecision:
        return LinearPrecision(self.input, self.weight)


BF16_LINEAR = LinearPrecision(None, None)


@dataclass(frozen=True)
class Recipe:
    """A named precision flow. Build with :func:`get_recipe`; frozen so it can be hashed and compared."""

    name: str
    train: LinearPrecision
    rollout: LinearPrecision
    ops: dict[str, str | KVCacheSpec] = field(default_factory=lambda: dict.fromkeys(NON_LINEAR_OPS, "bf16"))
    rollout_ops: dict[str, str | KVCacheSpec] | None = None  # None: the rollout computes non-linear ops as ``ops``
    off_policy: bool = False
    description: str = ""

    def __post_init__(self) -> None:
        if self.rollout.grad_output is not None:
            raise ValueError(f"recipe {self.name!r}: the rollout has no backward; give it a forward-only spec")
        for ops in (self.ops, self.rollout_ops or {}):
            kv = ops.get("kv_cache", "bf16")
            if kv != "bf16" and not isinstance(kv, KVCacheSpec):
                raise ValueError(
                    f"recipe {self.name!r}: kv_cache={kv!r}; use 'bf16' (the model dtype) or a KVCacheSpec"
                )

    def __hash__(self) -> int:
        ops = (tuple(sorted(self.ops.items())), tuple(sorted((self.rollout_ops or {}).items())))
        return hash((self.name, self.train, self.rollout, ops, self.off_policy))

    def linear(self, phase: Phase) -> LinearPrecision:
        """The linear-layer precision of ``phase`` ('train' or 'rollout')."""
        return self.train if phase == "train" else self.rollout

    def kv_cache(self, phase: Phase) -> KVCacheSpec | None:
        """The FP8 KV spec of ``phase``, or None when K/V stay in the model dtype."""
        ops = self.rollout_ops if phase == "rollout" and self.rollout_ops is not None else self.ops
        kv = ops.get("kv_cache", "bf16")
        return kv if isinstance(kv, KVCacheSpec) else None

    @property
    def quantizes_kv(self) -> bool:
        """True if K/V are FP8 in either phase (the model then needs the KV transform)."""
        return self.kv_cache("train") is not None or self.kv_cache("rollout") is not None

    def forward_graph(self, phase: Phase) -> dict[str, QuantSpec | str | None]:
        """Op -> how its forward is computed in ``phase``; the unit of the subgraph check."""
        lin = self.linear(phase)
        ops = self.rollout_ops if phase == "rollout" and self.rollout_ops is not None else self.ops
        return {"linear.input": lin.input, "linear.weight": lin.weight, **ops}

    def metadata(self) -> dict:
        """What a run logs about its precision flow."""
        report = check_rollout_subgraph(self, allow_off_policy=True)
        return {
            "recipe": self.name,
            "on_policy": report["on_policy"],
            "declared_off_policy": self.off_policy,
            "mismatched_ops": report["mismatched_ops"],
            "train_fp8_fprop": self.train.is_fp8,
            "train_fp8_backward": self.train.grad_output is not None,
            "rollout_fp8": self.rollout.is_fp8,
            "train_fp8_kv": self.kv_cache("train") is not None,
            "rollout_fp8_kv": self.kv_cache("rollout") is not None,
            "pow2_scale": any(  # the linear layers' operands
                s is not None and s.pow2_scale for lin in (self.train, self.rollout) for s in (lin.input, lin.weight)
            ),
            "kv_pow2_scale": any(s is not None and s.pow2_scale for s in (self.kv_cache(p) for p in PHASES)),
        }


def check_rollout_subgraph(recipe: Recipe, allow_off_policy: bool = False) -> dict:
    """Raise unless every rollout op is computed exactly as in the training forward.

    Returns ``{"on_policy": bool, "mismatched_ops": [...]}``. A mismatch raises
    :class:`OffPolicyRecipeError` unless the recipe declares ``off_policy=True`` (or the
    caller only wants the report). Call it when a run starts.
    """
    train, rollout = recipe.forward_graph("train"), recipe.forward_graph("rollout")
    mismatched = [op for op in rollout if rollout[op] != train.get(op)]
    if mismatched and not (recipe.off_policy or allow_off_policy):
        details = "; ".join(f"{op}: train={train.get(op)} rollout={rollout[op]}" for op in mismatched)
        raise OffPolicyRecipeError(
            f"recipe {recipe.name!r}: the rollout graph is not a subgraph of the training forward "
            f"({details}). Quantize these ops identically in both, or declare the recipe off_policy=True "
            "and enable rollout correction (TIS/MIS)."
        )
    return {"on_policy": not mismatched, "mismatched_ops": mismatched}


def get_recipe(name: str, *, pow2_scale: bool = False) -> Recipe:
    """The named recipe. ``pow2_scale`` switches every FP8 operand (both sides, KV cache included)
    to power-of-two scales."""
    act = QuantSpec((1, BLOCK), pow2_scale)
    weight = QuantSpec((BLOCK, BLOCK), pow2_scale)
    fp8_fwd = LinearPrecision(act, weight)
    fp8_full = LinearPrecision(act, weight, grad_output=act, wgrad=act)
    bf16_ops = dict.fromkeys(NON_LINEAR_OPS, "bf16")
    fp8_kv_ops = {**bf16_ops, "kv_cache": KVCacheSpec(pow2_scale=True)}  # KV scales are always pow2 (docstring)
    recipes = {
        "bf16": Recipe("bf16", BF16_LINEAR, BF16_LINEAR, description="BF16 training and BF16 rollout"),
        "fp8_rollout": Recipe(
            "fp8_rollout",
            BF16_LINEAR,
            fp8_fwd,
            off_policy=True,
            description="BF16 training + FP8 block rollout re-quantized from BF16 weights (off-policy baseline)",
        ),
        "jet": Recipe(
            "jet",
            fp8_full,
            fp8_fwd,
            description="Jet-RL: FP8 fprop/dgrad/wgrad; rollout runs the same FP8 forward graph",
        ),
        "jet_kv": Recipe(
            "jet_kv",
            fp8_full,
            fp8_fwd,
            ops=fp8_kv_ops,
            description="jet + unified FP8 KV cache: the trainer sees K/V through the rollout cache's quantizer "
            "(E4M3, one scale per token per KV head; straight-through backward)",
        ),
        "fp8kv_rollout": Recipe(
            "fp8kv_rollout",
            BF16_LINEAR,
            BF16_LINEAR,
            ops=bf16_ops,
            rollout_ops=fp8_kv_ops,
            off_policy=True,
            description="BF16 training + FP8 KV cache in the rollout only (off-policy FP8-KV baseline)",
        ),
    }
    if name not in recipes:
        raise ValueError(f"unknown recipe {name!r}; choose one of {sorted(recipes)}")
    recipe = recipes[name]
    if pow2_scale and name != "bf16":
        recipe = replace(recipe, name=f"{name}+pow2")
    return recipe


RECIPE_NAMES = ("bf16", "fp8_rollout", "jet", "jet_kv", "fp8kv_rollout")

# ---------------------------------------------------------------------------------------
# The phase a forward runs in. The trainer runs in "train" (the default); the engine wraps
# its forwards in ``precision_phase("rollout")``. Float8Linear and the KV transform read it to
# pick their spec.
_phase: list[Phase] = ["train"]


def current_phase() -> Phase:
    return _phase[-1]


@contextlib.contextmanager
def precision_phase(phase: Phase) -> Iterator[None]:
    if phase not in PHASES:
        raise ValueError(f"unknown precision phase {phase!r}; use one of {PHASES}")
    _phase.append(phase)
    try:
        yield
    finally:
        _phase.pop()
