"""Llama-family decoder (Llama 2/3, Qwen2, Qwen3) in plain PyTorch.

Why: the RL stack needs a model it fully owns -- parameter names identical to HF
``transformers`` (so checkpoints map 1:1), every projection an ``nn.Linear`` module
(so an FP8 transform can swap them), and one explicit place where K/V are produced
(so an FP8 KV cache can quantize them there, and the trainer can see the same quantized K/V
through ``Attention.kv_quant``). No HF runtime dependency.

Math, per layer (pre-norm residual):

    RMSNorm(x)  = w * (x / sqrt(mean(x^2) + eps))      computed in fp32, cast back before * w
    q, k, v     = W_q n, W_k n, W_v n                   (+ bias for Qwen2), n = RMSNorm(x)
    q, k        = RMSNorm_head(q), RMSNorm_head(k)      (Qwen3 only, per head, before RoPE)
    RoPE(x)_p   = x * cos(p * inv_freq) + rotate_half(x) * sin(p * inv_freq)
                  with HF's half-split convention: rotate_half([a, b]) = [-b, a]
    attn        = softmax(q k^T / sqrt(d) + causal/padding mask) v, each kv head shared by
                  num_heads / num_kv_heads query heads (GQA)
    h           = x + W_o attn
    out         = h + W_down(silu(W_gate m) * W_up m), m = RMSNorm(h)

Each residual add is done by the norm that reads the sum (``RMSNorm.add_forward``: one kernel on the fused
path), so a layer returns ``(h, W_down(...))`` unadded and the next layer's input norm (or the final norm)
adds them.

Padding: ``attention_mask`` (1 = token, 0 = pad) handles left and right padding; the
default ``position_ids`` are ``cumsum(mask) - 1`` clamped at 0, so a left-padded row gets
the same positions as the unpadded sequence. A 4-D boolean mask is passed to attention as
is (the rollout engine's static KV cache, whose rows have different lengths, builds one).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from jetrl.models.config import ModelConfig
from jetrl.models.fused import OutputQuant, add_rms_norm, norm_rope, published, rms_norm, silu_mul


class KVCache(Protocol):
    """What ``CausalLM.forward(kv_cache=...)`` needs from a cache.

    ``offset`` is the number of positions already cached; it is read once, at the start
    of a forward call, before any ``update``. ``update(layer_idx, k, v)`` receives this
    call's keys/values as ``(B, num_kv_heads, T, head_dim)`` -- after RoPE and k-norm --
    stores them and returns the keys/values to attend over, ``(B, num_kv_heads, offset + T,
    head_dim)``, in the model dtype. A cache that stores a lower precision (an FP8 cache)
    returns what it stored, dequantized: attention sees exactly the cached values.

    Optional: a cache may expose ``attend(layer_idx, q, k, v) -> (B, H, T, D)``, not None, to
    store k/v *and* compute attention itself (a fused decode kernel that reads FP8 K/V
    directly); the model then skips ``update`` and its own attention for that call. With the
    attention's ``output_quant`` slot filled, it is called as ``attend(..., quantized=buffers)`` and
    also writes o_proj's FP8 input (``jetrl.models.fused.OutputQuant``).
    """

    offset: int

    def update(self, layer_idx: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]: ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        # The FP8 codes of the output, for the linear layer that reads it: None in the pure model; the FP8
        # transform installs jetrl.fp8.producer_quant.ProducerQuant (jetrl.models.fused.OutputQuant)
        self.output_quant: OutputQuant | None = None

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps, self.output_quant)  # the formula: jetrl/models/fused.py

    def add_forward(self, x: Tensor, delta: Tensor) -> tuple[Tensor, Tensor]:
        """``(x + delta, self(x + delta))``: a residual add and this norm, one kernel on the fused path (which
        reads ``weight`` and ``eps`` without calling ``forward``: hooks on this module fire on the reference
        path only)."""
        return add_rms_norm(x, delta, self.weight, self.eps, self.output_quant)


def rope_inv_freq(config: ModelConfig) -> Tensor:
    """fp32 inverse frequencies (head_dim // 2,), with optional Llama-3 scaling; on CPU."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d))
    rs = config.rope_scaling
    if rs is None:
        return inv_freq
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old_len = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Maps position ids to (cos, sin) of shape (B, T, head_dim) in the activation dtype.

    ``inv_freq`` is a plain fp32 attribute, not a buffer: it never lands in state dicts,
    survives ``model.to(torch.bfloat16)`` at full precision and needs no re-init after a
    meta-device construction. It follows ``position_ids`` to their device lazily.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.inv_freq = rope_inv_freq(config)

    def forward(self, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        if self.inv_freq.device != position_ids.device:
            self.inv_freq = self.inv_freq.to(position_ids.device)
        freqs = position_ids[..., None].float() * self.inv_freq  # (B, T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = hd = config.head_dim
        h, qkv_bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * hd, bias=qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * hd, bias=qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * hd, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * hd, h, bias=config.attention_out_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(hd, config.rms_norm_eps)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # A transform of the final K/V when no cache is attached, ``(k, v) -> (k, v)``: None in the
        # pure model; the FP8 transform installs jetrl.fp8.kv_quant.KVQuant (quantize->dequantize).
        self.kv_quant: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]] | None = None
        # q/k/v as one GEMM, ``(attn, x) -> (q, k, v) | None`` (None: use the three modules): None in the
        # pure model; jetrl.fp8.convert_to_float8 installs jetrl.models.stacked_projections.StackedProjections
        # (BF16, no autograd, CUDA).
        self.qkv_stack: Callable[[nn.Module, Tensor], tuple[Tensor, ...] | None] | None = None
        # the FP8 codes of o_proj's input, written by a cache's fused ``attend``, like ``RMSNorm.output_quant``:
        # None in the pure model
        self.output_quant: OutputQuant | None = None

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, kv_cache: KVCache | None = None
    ) -> Tensor:
        B, T, _ = x.shape
        stacked = self.qkv_stack(self, x) if self.qkv_stack is not None else None
        q, k, v = stacked if stacked is not None else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        q = q.view(B, T, self.num_heads, self.head_dim)
        k = k.view(B, T, self.num_kv_heads, self.head_dim)
        v = v.view(B, T, self.num_kv_heads, self.head_dim)
        q, k = norm_rope(q, k, cos, sin, self.q_norm, self.k_norm)  # (B, H, T, D): q/k-norm (Qwen3), then RoPE
        v = v.transpose(1, 2)
        # KV hook: the single place where final K/V (post k-norm, post RoPE) exist.
        # A cache stores them here (an FP8 cache quantizes here) and returns all K/V to attend over;
        # without a cache, ``kv_quant`` applies the same quantize->dequantize (FP8 KV recipes).
        attend = getattr(kv_cache, "attend", None)  # optional fused path (KVCache docstring)
        quantized = None
        if attend is not None:
            if self.output_quant is not None:
                quantized = self.output_quant.buffers(B * T, self.num_heads * self.head_dim, x.device)
            extra = {} if quantized is None else {"quantized": quantized}
            out = attend(self.layer_idx, q, k, v, **extra)  # (B, H, T, D): the cache's fused kernel
        else:
            if kv_cache is not None:
                k, v = kv_cache.update(self.layer_idx, k, v)
            elif self.kv_quant is not None:
                k, v = self.kv_quant(k, v)
            out = self._attend(q, k, v, mask)  # (B, H, T, D)
        out = out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim)  # the very tensor o_proj reads
        return self.o_proj(published(out, self.output_quant, quantized))

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """SDPA over q (B, H, T, D) and k/v (B, Hkv, S, D).

        ``mask`` is a boolean (B|1, 1, T, S) "may attend" mask, or None meaning plain causal
        attention with q and k aligned (S == T), or full attention when T == 1.
        """
        if q.device.type == "cpu" and q.dtype == torch.float32:
            # CPU fp32: attend in fp64 and round back. SDPA's CPU kernels are not batch-invariant
            # (the same row differs by ~1e-7 between a padded batch and a single sequence), and
            # FP8 activation quantization downstream turns such ulps into whole-code flips; fp64
            # makes the rounded fp32 result independent of the kernel's summation order.
            return self._attend(q.double(), k.double(), v.double(), mask).float()
        B, H, T, D = q.shape
        if T == 1 and self.num_kv_heads != H:
            # Decode: fold the G = H / Hkv query heads of each kv head into the query-length axis,
            # (B, H, 1, D) -> (B, Hkv, G, D), so SDPA runs as plain multi-head attention. Same math
            # (query head h reads kv head h // G, as with enable_gqa); but SDPA's GQA path with an
            # attn_mask falls back to the math kernel, which materializes K/V repeated G times --
            # the whole KV cache copied G-fold per step. A (B|1, 1, 1, S) mask broadcasts over G.
            out = F.scaled_dot_product_attention(q.reshape(B, self.num_kv_heads, H // self.num_kv_heads, D), k, v,
                                                 attn_mask=mask)
            return out.reshape(B, H, 1, D)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None and T > 1,
            enable_gqa=self.num_kv_heads != H,
        )


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        # gate/up as one GEMM, like ``Attention.qkv_stack``: None in the pure model
        self.gate_up_stack: Callable[[nn.Module, Tensor], tuple[Tensor, ...] | None] | None = None
        # the FP8 codes of down_proj's input, like ``RMSNorm.output_quant``: None in the pure model
        self.act_quant: OutputQuant | None = None

    def forward(self, x: Tensor) -> Tensor:
        stacked = self.gate_up_stack(self, x) if self.gate_up_stack is not None else None
        gate, up = stacked if stacked is not None else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(silu_mul(gate, up, self.act_quant))  # silu(gate) * up


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, kv_cache: KVCache | None = None,
        delta: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """``(h, mlp_out)``: the layer's output ``h + mlp_out`` with its residual add left undone, and ``delta``
        the previous layer's ``mlp_out`` (None for the first layer), added here.

        Why unadded: each residual add is done by the norm that reads its sum (``RMSNorm.add_forward``, one
        kernel on the fused path): the next layer's input norm, or the model's final norm. At decode sizes a
        separate add is a launch-bound kernel of its own: folding it into the norm took 1.0-1.7 µs per layer off
        the decode step at B = 64 and 256 on an H200, logits bit-identical (bench/probe_residual_fusion.py,
        docs/benchmarks.md (d)); the sum is the same bf16 rounding of ``x + delta`` either way.
        """
        if delta is None:
            normed = self.input_layernorm(x)
        else:
            x, normed = self.input_layernorm.add_forward(x, delta)
        x, normed = self.post_attention_layernorm.add_forward(x, self.self_attn(normed, cos, sin, mask, kv_cache))
        return x, self.mlp(normed)


def build_attn_mask(attention_mask: Tensor | None, T: int, offset: int, device: torch.device) -> Tensor | None:
    """Boolean (B|1, 1, T, offset+T) mask, or None when SDPA's built-in causal path suffices.

    Each query also attends to itself, so rows whose keys are all padding (the pad
    positions of a left-padded batch) stay finite instead of producing NaN; real tokens
    are unaffected because they attend to themselves anyway.
    """
    S = offset + T
    if attention_mask is not None and attention_mask.dim() == 4:
        # A ready boolean "may attend" mask, passed through unchanged. A static per-slot KV cache
        # (jetrl.engine.kv_cache) needs it: its rows hold different numbers of valid positions, so
        # row b attends to keys [0, len_b] of a fixed-length cache, which no (B, S) padding mask
        # plus a shared causal offset can express. The caller must also pass ``position_ids``.
        if attention_mask.dtype != torch.bool or attention_mask.shape[-2:] != (T, S):
            raise ValueError(
                f"a 4-D attention_mask must be a bool (B|1, 1, T, offset+T) = (.., 1, {T}, {S}) 'may attend' "
                f"mask, got {attention_mask.dtype} {tuple(attention_mask.shape)}"
            )
        return attention_mask
    if attention_mask is None and (offset == 0 or T == 1):
        return None
    q_pos = torch.arange(offset, S, device=device)[:, None]
    k_pos = torch.arange(S, device=device)[None, :]
    mask = k_pos <= q_pos  # (T, S)
    if attention_mask is None:
        return mask[None, None]
    if attention_mask.shape[-1] != S:
        raise ValueError(
            f"attention_mask has length {attention_mask.shape[-1]} but must cover past + current tokens "
            f"({offset} + {T} = {S})"
        )
    return (mask & attention_mask.bool()[:, None, None, :]) | (k_pos == q_pos)


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> Tensor:
        B, T = input_ids.shape
        offset = kv_cache.offset if kv_cache is not None else 0
        if position_ids is None:
            if attention_mask is not None and attention_mask.dim() == 4:
                raise ValueError("a 4-D attention_mask carries no positions; pass position_ids with it")
            if attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]
            else:
                position_ids = torch.arange(offset, offset + T, device=input_ids.device).expand(B, T)
        mask = build_attn_mask(attention_mask, T, offset, input_ids.device)
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(position_ids, x.dtype)
        return self.run_layers(x, cos, sin, mask, kv_cache)

    def run_layers(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None = None,
                   kv_cache: KVCache | None = None) -> Tensor:
        """The decoder layers and the final norm over embedded tokens ``x`` (B, T, H), with RoPE's ``cos``/``sin``
        and ``mask`` as ``forward`` builds them: the part the trainer's CUDA graphs replay (jetrl/rl/train_graphs.py)."""
        delta = None  # each layer's output is x + delta, added by the next norm (DecoderLayer.forward)
        for layer in self.layers:
            x, delta = layer(x, cos, sin, mask, kv_cache, delta)
        return self.norm(x) if delta is None else self.norm.add_forward(x, delta)[1]


class CausalLM(nn.Module):
    """Decoder + LM head; parameter names match HF ``*ForCausalLM`` exactly."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        self.tie_weights()

    @staticmethod
    def _init_weights(module: nn.Module, std: float = 0.02) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def tie_weights(self) -> None:
        """With ``tie_word_embeddings`` the LM head shares the embedding Parameter."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def hidden_states(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> Tensor:
        """Final normed hidden states (B, T, hidden_size).

        ``attention_mask`` is (B, offset + T) -- past plus current tokens when a cache is used --
        or a ready boolean (B|1, 1, T, offset + T) "may attend" mask (then ``position_ids`` is required).
        """
        return self.model(input_ids, attention_mask, position_ids, kv_cache)

    def logits_from_hidden(self, h: Tensor) -> Tensor:
        return self.lm_head(h)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> Tensor:
        """Logits (B, T, vocab_size); see ``hidden_states`` for the arguments."""
        return self.logits_from_hidden(self.hidden_states(input_ids, attention_mask, position_ids, kv_cache))
