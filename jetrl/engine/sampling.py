"""Sampling parameters and the pure sampling function of the rollout engine.

Why its own file: RL needs more from sampling than text. The policy-gradient ratio and the
rollout-correction metrics (design.md §6) use the logprob of each sampled token, so the
sampler must return it, and it must be the logprob under the distribution the token was
*actually drawn from* (verl's "processed logprobs"):

    z      = logits / T                                    (B, V), fp32
    keep   = top-k then top-p support of softmax(z)        (sorted once, stable: ties keep the lower id)
    lp     = log_softmax(z masked to -inf outside keep)    renormalized over the support
    token ~ exp(lp),   logprob = lp[token]

Top-p keeps the smallest prefix of the descending-sorted (top-k-renormalized) distribution
whose mass reaches ``top_p``: token i is dropped iff the mass strictly before it is >= top_p,
so the most likely token is always kept.

Greedy (``temperature == 0``) draws from a point mass, whose logprob (0) says nothing. We
return instead the logprob under the *unmodified* softmax at temperature 1,
``log_softmax(logits)[argmax]``: the number the trainer computes for the same token, so
greedy rollouts can be compared with (and trained on against) the trainer directly.

Seeded sampling is counter-based, not stateful: each draw uses one uniform

    u = uniform(hash32(key_seq, step)) in (0, 1),   key_seq = hash(seed of the prompt, sample index)

computed with exact integer ops on the device, and inverse-CDF sampling
``token = min{i : cdf_i > u * cdf_V}`` over ``exp(lp)`` in vocabulary order. A sequence's
draw therefore depends only on (its seed, its sample index, its step, its own logits): not
on what else is in the batch, which slot it sits in, or how many steps ran before it was
admitted; and the same integers give the same uniforms on CPU and GPU. No ``torch.Generator``
state, one kernel for the whole batch, and no host sync.

Backend: :func:`sample_reference` below is the spec, in plain PyTorch. :func:`sample` runs it, or
for parameters that do not truncate (top-k/top-p off; greedy included) on CUDA with Triton the fused
kernel of :mod:`jetrl.engine.kernels.sample_triton`: the same distribution and the same uniforms,
~1 read of the logits in their own dtype instead of ~8 fp32 passes (31 µs instead of 720 µs at
B = 256, V = 151936 on the H200). A token can differ from the spec's only where the draw lies within
fp32 rounding of a cdf boundary, as the spec's own tokens differ between CPU and GPU.
``JETRL_FUSED_SAMPLER=0`` turns the kernel off, ``=1`` asks for it wherever the parameters allow
(CPU tensors then need ``TRITON_INTERPRET=1``); :func:`use_fused_sampler` overrides both inside a
block (tests, benchmarks).
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, field

import torch
from torch import Tensor

from jetrl.exact import exact_requested
from jetrl.overrides import ScopedOverride, env_choice

M32 = 0xFFFFFFFF
M64 = 0xFFFFFFFFFFFFFFFF
GREEDY_BELOW = 1e-5  # a temperature under this decodes greedily (vLLM's _SAMPLING_EPS)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample completions. Frozen (hashable, safe to share); validated on construction.

    n:              completions per prompt (a GRPO group); the prompt is prefilled once for all n.
    temperature:    softmax temperature; 0 (or anything below 1e-5, as in vLLM) means greedy decoding.
    top_p:          nucleus mass in (0, 1]; 1 disables it.
    top_k:          keep the k most likely tokens; 0 disables it.
    max_tokens:     maximum number of generated tokens per completion.
    seed:           base seed; None draws one from torch's global RNG (so ``torch.manual_seed``
                    makes a run reproducible). Prompt i and sample j get their own stream.
    stop_token_ids: extra token ids that end a completion (kept in its token ids, not in its text; its
                    ``stop_reason``; a stop on the model's EOS has stop_reason None, as in vLLM).
    stop:           strings that end a completion (needs a tokenizer); the token that completes
                    one is kept in the ids, the text is cut before the string.
    ignore_eos:     do not stop on the model's / tokenizer's EOS ids (only on ``stop_token_ids``).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default=())
    stop: tuple[str, ...] = field(default=())
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # Normalize sequences to tuples so the dataclass stays hashable.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"SamplingParams.n={self.n!r} must be an int >= 1 (completions per prompt)")
        if (
            not isinstance(self.temperature, (int, float))
            or not math.isfinite(self.temperature)
            or self.temperature < 0
        ):
            raise ValueError(
                f"SamplingParams.temperature={self.temperature!r} must be a finite number >= 0 "
                "(0 means greedy decoding; 1 samples from the model's distribution)"
            )
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(
                f"SamplingParams.top_p={self.top_p!r} must be in (0, 1]; use 1.0 to disable nucleus sampling"
            )
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k={self.top_k!r} must be an int >= 0; use 0 to disable top-k")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens={self.max_tokens!r} must be an int >= 1")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"SamplingParams.seed={self.seed!r} must be an int or None")
        bad_ids = [t for t in self.stop_token_ids if not _is_int(t) or t < 0]
        if bad_ids:
            raise ValueError(f"SamplingParams.stop_token_ids holds {bad_ids}; token ids are ints >= 0")
        bad_stop = [s for s in self.stop if not isinstance(s, str) or not s]
        if bad_stop:
            raise ValueError(f"SamplingParams.stop holds {bad_stop!r}; stop strings must be non-empty str")

    @property
    def is_greedy(self) -> bool:
        """Temperature 0, or below GREEDY_BELOW (as vLLM: there logits / T overflow fp32 and the softmax is NaN)."""
        return self.temperature < GREEDY_BELOW

    def truncates(self, vocab: int) -> bool:
        """True if top-k or top-p cut the support of a ``vocab``-token distribution (a sort over it is needed);
        a top_k of at least ``vocab`` cuts nothing."""
        return not self.is_greedy and (0 < self.top_k < vocab or self.top_p < 1)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# ----------------------------------------------------------------------------- the distribution
def processed_logprobs(logits: Tensor, params: SamplingParams) -> Tensor:
    """(B, V) logits -> (B, V) fp32 logprobs of the distribution sampled from (see module docstring).

    Greedy returns the unmodified ``log_softmax(logits)`` (temperature 1, no truncation).
    """
    z = logits.float()
    if params.is_greedy:
        return torch.log_softmax(z, dim=-1)
    if params.temperature != 1:
        z = z / params.temperature
    if params.truncates(z.shape[-1]):
        z = z.masked_fill(_truncated(z, params), float("-inf"))
    return torch.log_softmax(z, dim=-1)


def _truncated(z: Tensor, params: SamplingParams) -> Tensor:
    """(B, V) bool: True where top-k / top-p drop a token. One stable descending sort."""
    sorted_z, order = torch.sort(z, dim=-1, descending=True, stable=True)
    drop = torch.zeros_like(sorted_z, dtype=torch.bool)
    if 0 < params.top_k < z.shape[-1]:
        drop[:, params.top_k :] = True
    if params.top_p < 1:
        probs = torch.softmax(sorted_z.masked_fill(drop, float("-inf")), dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop |= mass_before >= params.top_p
        drop[:, 0] = False  # the most likely token always survives
    return torch.zeros_like(drop).scatter_(-1, order, drop)


# ----------------------------------------------------------------------------- counter-based noise
def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32), without int64 overflow (split c in 16-bit halves)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & M32


def _mix32(x: Tensor) -> Tensor:
    """lowbias32 integer finalizer (C. Wellons): a bijection on 32-bit ints with strong avalanche."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def counter_uniform(keys: Tensor, steps: Tensor) -> Tensor:
    """(B,) int64 keys and steps -> (B,) fp32 uniforms in (0, 1), a pure function of (key, step).

    23 random bits, centered: u = (2k + 1) / 2^24 with k < 2^23, exact in fp32, never 0 or 1.
    """
    h = _mix32((keys & M32) ^ _mix32((steps & M32) ^ 0x9E3779B9))
    return (2 * (h >> 9) + 1).to(torch.float32) * (2.0**-24)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def prompt_seed(seed: int, prompt_index: int) -> int:
    """The seed of prompt ``prompt_index`` of a call whose ``SamplingParams.seed`` is ``seed``."""
    return _splitmix64((seed & M64) ^ _splitmix64(prompt_index))


def sequence_key(prompt_seed: int, sample_index: int) -> int:
    """The 32-bit noise key of sample ``sample_index`` of a prompt with seed ``prompt_seed``."""
    return _splitmix64((prompt_seed & M64) ^ _splitmix64(sample_index + (1 << 40))) & M32


# ----------------------------------------------------------------------------- sampling
def sample(logits: Tensor, params: SamplingParams, keys: Tensor, steps: Tensor) -> tuple[Tensor, Tensor]:
    """Draw one token per row: :func:`sample_reference`, or its fused kernel where it applies
    (module docstring, :func:`uses_fused_sampler`). No host sync.

    logits: (B, V) float (the kernel reads bf16, fp16 and fp32 as they are); keys, steps: (B,) int64.
    Returns tokens (B,) int64 and their processed logprobs (B,) fp32.
    """
    _validate(logits, keys, steps)
    if not uses_fused_sampler(logits, params):
        tokens, logprobs = sample_reference(logits, params, keys, steps)
    else:
        from jetrl.engine.kernels.sample_triton import sample_triton

        tokens, logprobs = sample_triton(logits if logits.stride(-1) == 1 else logits.contiguous(), params, keys, steps)
    if exact_requested() and not params.truncates(logits.shape[-1]):
        # exact mode (jetrl/exact.py), on every device: the logprob by the trainer's own function, the bits it
        # recomputes (the sampler's own reduction agrees to ~1e-6 only)
        from jetrl.rl.token_logprobs import chosen_token_logprobs  # lazy: rl imports the engine

        logprobs = chosen_token_logprobs(logits, tokens, 1.0 if params.is_greedy else params.temperature)
    return tokens, logprobs


def sample_reference(logits: Tensor, params: SamplingParams, keys: Tensor, steps: Tensor) -> tuple[Tensor, Tensor]:
    """The spec, in PyTorch: draw one token per row (module docstring). No host sync.

    logits: (B, V) any float dtype (processed in fp32); keys, steps: (B,) int64 (see module
    docstring). Returns tokens (B,) int64 and their processed logprobs (B,) fp32.
    """
    if params.is_greedy:
        tokens = logits.argmax(dim=-1)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
    else:
        logprobs = processed_logprobs(logits, params)
        cdf = logprobs.exp().cumsum(dim=-1)  # (B, V); masked tokens add exactly 0
        total = cdf[:, -1:].contiguous()  # (B, 1)
        target = counter_uniform(keys, steps)[:, None] * total
        # The first index whose cdf exceeds the target has probability > 0 (a 0 leaves the cdf
        # unchanged). If fp32 rounding puts the target at the total, take the last token of
        # positive probability: the first index where the cdf reaches its total.
        tokens = torch.minimum(
            torch.searchsorted(cdf, target, right=True), torch.searchsorted(cdf, total, right=False)
        ).squeeze(-1)
        # a row with no distribution (all -inf, or NaN / +inf logits: its total is NaN) gets token 0 and a NaN
        # logprob, as the fused kernel gives it; searchsorted would point past the vocabulary
        tokens = torch.where(total.squeeze(-1) > 0, tokens, 0)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def _validate(logits: Tensor, keys: Tensor, steps: Tensor) -> None:
    if logits.dim() != 2 or logits.shape[-1] == 0:
        raise ValueError(f"sample: logits must be (B, V) with V >= 1 (one row per sequence), got {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise TypeError(f"sample: logits must be a float tensor (bf16, fp16 or fp32), got {logits.dtype}")
    for name, t in (("keys", keys), ("steps", steps)):
        if t.shape != logits.shape[:1] or t.dtype != torch.int64:
            raise ValueError(
                f"sample: {name} must be ({logits.shape[0]},) int64, one per row of logits {tuple(logits.shape)}; "
                f"got {t.dtype} {tuple(t.shape)}"
            )


# ----------------------------------------------------------------------------- backend
_ENV = "JETRL_FUSED_SAMPLER"
_override = ScopedOverride("fused-sampler setting", (True, False))


def fused_sampler_requested() -> bool | None:
    """True/False if the fused sampler is forced on/off (innermost :func:`use_fused_sampler`, else
    ``JETRL_FUSED_SAMPLER``), None for the default: on for CUDA logits when Triton is installed."""
    if _override.value is not None:
        return _override.value
    flag = env_choice(_ENV, ("0", "1"), "1 = the fused Triton sampler, also on CPU under TRITON_INTERPRET=1; "
                                        "0 = the PyTorch reference")
    return None if flag is None else flag == "1"


def uses_fused_sampler(logits: Tensor, params: SamplingParams) -> bool:
    """True if :func:`sample` runs the fused kernel for these logits and params.

    Never for truncating params (top-k/top-p: a sort, the reference's job) or a logits dtype the kernel
    does not read. Forced on, it raises an actionable error where it cannot run.
    """
    requested = fused_sampler_requested()
    from jetrl.fp8.kernels import KERNEL_FLOAT_DTYPES, has_triton

    if requested is False or params.truncates(logits.shape[-1]) or logits.dtype not in KERNEL_FLOAT_DTYPES:
        return False

    if requested is None:
        return logits.is_cuda and has_triton()
    if not has_triton():
        raise RuntimeError(f"the fused sampler needs Triton: pip install triton, or unset {_ENV} / "
                           "use_fused_sampler(False) for the PyTorch reference")
    if not logits.is_cuda and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise RuntimeError(
            f"the fused sampler needs CUDA logits, got {logits.device.type}; set TRITON_INTERPRET=1 (before "
            f"importing triton) to run the kernel on the CPU, or unset {_ENV} / use_fused_sampler(False)"
        )
    return True


def use_fused_sampler(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """Force the fused sampler on or off inside the block, on every device (tests, benchmarks).

    Sampling runs outside the engine's CUDA graphs, so toggling it needs no recapture.
    """
    return _override(bool(enabled))
