"""What ``jetrl bench`` measures at which size: Qwen3-8B shapes on the H200, tiny ones in ``--smoke``.

The model is an 8B-shaped Qwen3 with random weights (hidden 4096, SwiGLU 12288, 32 query
heads and 8 KV heads of 128, 36 layers, vocabulary 151936): speed depends on shapes, not on
trained values. The four GEMMs of one layer follow from it (y = x W^T, W is N x K):

    qkv      K = 4096   N = (32 + 2 * 8) * 128 = 6144     (q, k, v fused)
    o        K = 32 * 128 = 4096   N = 4096
    gate_up  K = 4096   N = 2 * 12288 = 24576             (gate, up fused)
    down     K = 12288  N = 4096

Every size and iteration count of every section lives in one frozen :class:`BenchConfig`;
:func:`h200_config` is the full run (252 s on an H200 on 2026-11-30, before section (c) rotated
weight copies and (d) added the fused-ops rows),
:func:`smoke_config` the CPU smoke run (same code paths, tiny shapes, 1-2 iterations).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from jetrl.models.config import ModelConfig


def qwen3_config(*, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, vocab: int,
                 layers: int) -> ModelConfig:
    """A Qwen3 ModelConfig (q/k norm, no biases, untied head); ``eos_token_id=None``: nothing stops early."""
    return ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, qk_norm=True,
                       rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=40960,
                       architecture="Qwen3ForCausalLM", eos_token_id=None)


@dataclass(frozen=True)
class BenchConfig:
    """Sizes and iteration counts of every section (see each field's comment)."""

    smoke: bool
    # the model (8B-shaped Qwen3 on the H200)
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    layers: int  # sections d, e
    train_layers: int  # sections f, g (36: Qwen3-8B itself; fewer for a quicker run)
    # timing
    iters: int  # CUDA-event-timed iterations (median)
    warmup: int
    graph_calls: int  # calls captured back to back in one CUDA graph (section c, decode KV quant)
    back_to_back: int  # calls enqueued back to back per timed region in (a), (b): host ahead, as in training
    graph_replays: int
    # (a) quantizer inputs
    act_shape: tuple[int, int]  # (tokens, hidden) bf16 activation
    weight_shape: tuple[int, int]  # (intermediate, hidden) weight
    kv_prefill_tokens: int  # K of a prefill: (tokens, kv_heads, head_dim), one group per token-head
    kv_decode_rows: int  # K of a decode step: (batch, kv_heads, head_dim)
    # (b) Float8Linear tokens
    linear_tokens: int
    # (c) decode GEMM rows
    decode_ms: tuple[int, ...]
    # (d) decode step
    decode_batch: int
    decode_context: int  # mean cached context; lengths spread uniformly over [ctx/5, 9 ctx/5]
    # (e) rollout
    rollout_batch: int
    rollout_prompt: int
    rollout_new: int
    hf_new: int  # HF generate runs ~110 ms/step at batch 256: fewer new tokens, same prompts
    long_context: bool  # also the long-context config below (jet_kv vs bf16)
    long_batch: int
    long_prompt: int
    long_new: int
    # (f) training phase and (g) end-to-end RL step
    train_batch: int  # sequences of train_prompt + train_completion tokens
    train_prompt: int
    train_completion: int
    micro_batch: int  # per_device_train_batch_size (gradient accumulation covers the batch)
    train_iters: int  # timed training phases per recipe, after one warm-up
    rl_prompts: int
    rl_generations: int
    rl_prompt: int
    rl_completion: int
    rl_steps: int  # timed RL steps per recipe, after one warm-up step
    torchao: bool = False  # (b) also torchao's blockwise FP8 linear (--torchao; jetrl/bench/torchao_baseline.py)
    # (f) also the training phase of a smaller model, where eager FP8 is host-bound: (label, fields to replace)
    small_train: tuple[str, dict] | None = None
    # (f), (g): GRPOConfig.train_cuda_graphs of both recipes' trainers ('auto' = as shipped)
    train_cuda_graphs: str = "auto"

    def __post_init__(self) -> None:
        if self.layers < 1 or self.train_layers < 1:
            raise ValueError(f"--layers={self.layers} and --train-layers={self.train_layers} must be >= 1")
        if self.micro_batch < 1:
            raise ValueError(f"--micro-batch={self.micro_batch} must be >= 1")
        if self.train_batch % self.micro_batch or (self.rl_prompts * self.rl_generations) % self.micro_batch:
            raise ValueError(f"--micro-batch={self.micro_batch} must divide train_batch={self.train_batch} and "
                             f"rl_prompts * rl_generations={self.rl_prompts * self.rl_generations}")

    def model_config(self, layers: int) -> ModelConfig:
        return qwen3_config(hidden=self.hidden, intermediate=self.intermediate, heads=self.heads,
                            kv_heads=self.kv_heads, head_dim=self.head_dim, vocab=self.vocab, layers=layers)

    def layer_gemms(self) -> list[tuple[str, int, int]]:
        """(name, K, N) of the four GEMMs of one decoder layer (module docstring)."""
        q_out = self.heads * self.head_dim
        return [("qkv", self.hidden, q_out + 2 * self.kv_heads * self.head_dim), ("o", q_out, self.hidden),
                ("gate_up", self.hidden, 2 * self.intermediate), ("down", self.intermediate, self.hidden)]


def h200_config(*, layers: int = 36, train_layers: int = 36, micro_batch: int = 8,
                long_context: bool = True) -> BenchConfig:
    """The full run: Qwen3-8B shapes, the issue's batch sizes, about 7-8 minutes on one H200 (f and g train the
    whole 36-layer model: 8.19B parameters, AdamW and micro-batches of 8 x 1152 tokens peak at ~135 GiB; f then
    also Qwen3-1.7B's shapes, ~15 s)."""
    return BenchConfig(
        smoke=False, hidden=4096, intermediate=12288, heads=32, kv_heads=8, head_dim=128, vocab=151936,
        layers=layers, train_layers=train_layers,
        iters=20, warmup=5, graph_calls=20, graph_replays=10, back_to_back=10,
        act_shape=(8192, 4096), weight_shape=(12288, 4096), kv_prefill_tokens=256 * 128, kv_decode_rows=256,
        linear_tokens=8192, decode_ms=(1, 16, 64, 256),
        decode_batch=256, decode_context=640,
        rollout_batch=256, rollout_prompt=128, rollout_new=1024, hf_new=64,
        long_context=long_context, long_batch=64, long_prompt=3072, long_new=1024,
        train_batch=16, train_prompt=128, train_completion=1024, micro_batch=micro_batch, train_iters=3,
        rl_prompts=8, rl_generations=8, rl_prompt=128, rl_completion=1024, rl_steps=2,
        small_train=("Qwen3-1.7B shapes", QWEN3_1_7B),
    )


# Qwen3-1.7B's layer shapes (head_dim 128 as the 8B's; the bench keeps the 8B's vocabulary and an untied lm_head)
QWEN3_1_7B = {"hidden": 2048, "intermediate": 6144, "heads": 16, "kv_heads": 8, "train_layers": 28}
# the layer shapes of the Qwen3 sizes the probes take (BenchConfig fields; same head_dim, vocabulary, lm_head)
QWEN3_SHAPES = {
    "0.6b": {"hidden": 1024, "intermediate": 3072, "heads": 16, "kv_heads": 8, "train_layers": 28},
    "1.7b": QWEN3_1_7B,
    "4b": {"hidden": 2560, "intermediate": 9728, "heads": 32, "kv_heads": 8, "train_layers": 36},
    "8b": {"hidden": 4096, "intermediate": 12288, "heads": 32, "kv_heads": 8, "train_layers": 36},  # h200_config's
}


def smoke_config(*, layers: int = 2, train_layers: int = 2, micro_batch: int = 2,
                 long_context: bool = True) -> BenchConfig:
    """Every section's code path at tiny shapes (CPU CI): 128-wide heads so every FP8 group is whole."""
    full = h200_config(layers=layers, train_layers=train_layers, long_context=long_context)
    return replace(
        full, smoke=True, hidden=256, intermediate=512, heads=2, kv_heads=1, head_dim=128, vocab=512,
        iters=1, warmup=1, graph_calls=2, graph_replays=1, back_to_back=2,
        act_shape=(64, 256), weight_shape=(512, 256), kv_prefill_tokens=16, kv_decode_rows=4,
        linear_tokens=32, decode_ms=(1, 4),
        decode_batch=4, decode_context=10,
        rollout_batch=4, rollout_prompt=8, rollout_new=6, hf_new=4,
        long_batch=2, long_prompt=24, long_new=4,
        train_batch=4, train_prompt=8, train_completion=8, micro_batch=micro_batch, train_iters=1,
        rl_prompts=2, rl_generations=2, rl_prompt=8, rl_completion=6, rl_steps=1,
        small_train=("half width", {"hidden": 128, "intermediate": 256, "heads": 1, "train_layers": 1}),
    )
