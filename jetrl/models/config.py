"""Model configuration for the Llama-style decoder family (Llama, Qwen2, Qwen3).

Why: one dataclass describes every supported checkpoint, so the model code has a
single source of truth and the loader can map an HF ``config.json`` onto it (and
back) without importing ``transformers``.

The three families share one block (pre-norm, GQA attention with RoPE, SwiGLU MLP):

    h = x + o_proj(Attn(RoPE(q_norm(W_q x)), RoPE(k_norm(W_k x)), W_v x))
    y = h + down_proj(silu(gate_proj(n)) * up_proj(n)),   n = RMSNorm(h)

and differ only in three switches, all fields here:

* ``attention_bias``      -- bias on q/k/v (Qwen2: always on),
* ``attention_out_bias``  -- bias on o_proj (Llama/Qwen3 tie it to ``attention_bias``;
  Qwen2 never has one),
* ``qk_norm``             -- per-head RMSNorm on q and k before RoPE (Qwen3).

RoPE frequencies are ``inv_freq_i = theta^(-2i/d)`` for ``i < d/2``. With Llama-3
scaling (``rope_scaling["rope_type"] == "llama3"``), wavelengths ``w = 2*pi/inv_freq``
longer than ``L/low_freq_factor`` are divided by ``factor``, those shorter than
``L/high_freq_factor`` are kept, and the band in between is interpolated with
``s = (L/w - low) / (high - low)``: ``inv = (1-s)*inv/factor + s*inv``, where ``L`` is
``original_max_position_embeddings``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# HF architecture name -> HF model_type.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_ARCH_BY_MODEL_TYPE = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(kw_only=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None  # None -> num_attention_heads (plain MHA)
    head_dim: int | None = None  # None -> hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # None, {"rope_type": "default"} or llama3
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    attention_out_bias: bool = False
    qk_norm: bool = False
    architecture: str = "LlamaForCausalLM"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, repr=False)  # unmodelled HF keys, kept for round trips

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {getattr(self, name)!r}")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"num_attention_heads={self.num_attention_heads} does not divide hidden_size={self.hidden_size}; "
                    "pick a divisor or set head_dim explicitly"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_key_value_heads <= 0 or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads={self.num_key_value_heads} must be positive and divide "
                f"num_attention_heads={self.num_attention_heads} (grouped-query attention shares each kv head "
                "across an equal number of query heads)"
            )
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be a positive even number (RoPE rotates pairs)")
        if self.rms_norm_eps <= 0:
            raise ValueError(f"rms_norm_eps={self.rms_norm_eps} must be > 0")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta={self.rope_theta} must be > 0")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(_unknown_arch_msg(self.architecture))
        self.rope_scaling = _normalize_rope_scaling(self.rope_scaling)

    @property
    def rope_type(self) -> str:
        return "default" if self.rope_scaling is None else self.rope_scaling["rope_type"]

    @property
    def model_type(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    # ------------------------------------------------------------------ HF mapping
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from an HF ``config.json`` dict (transformers 4.x or 5.x layout)."""
        archs = d.get("architectures") or []
        arch = archs[0] if archs else _ARCH_BY_MODEL_TYPE.get(d.get("model_type", ""), d.get("model_type"))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(_unknown_arch_msg(arch))
        model_type = SUPPORTED_ARCHITECTURES[arch]
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={d['hidden_act']!r} is not supported; only 'silu' (SwiGLU) is")
        if d.get("mlp_bias", False):
            raise ValueError("mlp_bias=true is not supported (no released Llama checkpoint uses it)")
        if d.get("use_sliding_window", False):
            raise ValueError("use_sliding_window=true is not supported; only full causal attention is implemented")

        # transformers>=5 nests theta into `rope_parameters`; older configs use rope_theta + rope_scaling.
        rope = d.get("rope_parameters")
        if rope is not None:
            rope = dict(rope)
            theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
        else:
            rope = d.get("rope_scaling")
            theta = d.get("rope_theta", 10000.0)

        if model_type == "qwen2":
            bias, out_bias = True, False
        else:
            bias = out_bias = bool(d.get("attention_bias", False))
        head_dim = d.get("head_dim") or (128 if model_type == "qwen3" else None)  # Qwen3Config default is 128

        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads"),
            head_dim=head_dim,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bias,
            attention_out_bias=out_bias,
            qk_norm=model_type == "qwen3",
            architecture=arch,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"),
            extra={k: v for k, v in d.items() if k not in known and k not in _DERIVED_HF_KEYS},
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """HF ``config.json`` dict, in the widely read rope_theta/rope_scaling layout."""
        mt = self.model_type
        expected = {
            "llama": (self.attention_bias, self.attention_bias, False),
            "qwen2": (True, False, False),
            "qwen3": (self.attention_bias, self.attention_bias, True),
        }[mt]
        if (self.attention_bias, self.attention_out_bias, self.qk_norm) != expected:
            raise ValueError(
                f"{self.architecture} cannot express attention_bias={self.attention_bias}, "
                f"attention_out_bias={self.attention_out_bias}, qk_norm={self.qk_norm}; "
                f"it requires (attention_bias, attention_out_bias, qk_norm)={expected}"
            )
        d: dict[str, Any] = dict(self.extra)
        d.update(
            architectures=[self.architecture],
            model_type=mt,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act="silu",
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
        )
        if mt == "qwen2":
            d["use_sliding_window"] = False
        else:
            d["attention_bias"] = self.attention_bias
        if mt == "llama":
            d["mlp_bias"] = False
        return d


# Keys that from_hf_dict consumes or that to_hf_dict re-derives; never stored in `extra`.
_DERIVED_HF_KEYS = frozenset(
    {"architectures", "model_type", "hidden_act", "rope_parameters", "rope_scaling", "rope_theta", "mlp_bias",
     "use_sliding_window", "sliding_window", "layer_types", "max_window_layers", "torch_dtype", "dtype",
     "transformers_version",
     # Read by the loader (FP8 checkpoints) and written by the exporter; never carried over, so a
     # BF16 save of a model loaded from an FP8 checkpoint does not claim to be quantized.
     "quantization_config"}
)


def _unknown_arch_msg(arch: object) -> str:
    return (
        f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)} "
        "(set `architectures` in config.json to one of these if the checkpoint really is one)"
    )


def _normalize_rope_scaling(rs: dict[str, Any] | None) -> dict[str, Any] | None:
    """Return None for plain RoPE, or a validated llama3 dict with a `rope_type` key."""
    if rs is None:
        return None
    rs = dict(rs)
    rope_type = rs.pop("type", None) or rs.get("rope_type") or "default"  # legacy key was "type"
    rs["rope_type"] = rope_type
    if rs.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported; RoPE rotates the full head_dim")
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported; use 'default' or 'llama3'")
    missing = [k for k in _LLAMA3_ROPE_KEYS if k not in rs]
    if missing:
        raise ValueError(f"llama3 rope_scaling is missing {missing}; it needs all of {list(_LLAMA3_ROPE_KEYS)}")
    if rs["high_freq_factor"] <= rs["low_freq_factor"]:
        raise ValueError("llama3 rope_scaling needs high_freq_factor > low_freq_factor")
    return rs
