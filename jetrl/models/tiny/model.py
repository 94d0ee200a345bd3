"""The tiny adder's model config: a 2-layer Llama with FP8-friendly dims.

Why every dim is a multiple of 16: FP8 recipes (``jet``) convert the projections to FP8, whose
tiles need 16-aligned dims; so the vocabulary is padded too (102 -> 112).
"""

from __future__ import annotations

from jetrl.models.config import ModelConfig
from jetrl.models.tiny.tokenizer import CHARACTERS, EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS

VOCAB_MULTIPLE = 16  # the model's vocab is padded to this (FP8 tiles need 16-aligned dims)


def tiny_model_config(vocab_size: int = len(SPECIAL_TOKENS) + len(CHARACTERS), *, num_hidden_layers: int = 2,
                      intermediate_size: int = 384) -> ModelConfig:
    """A Llama-family config with FP8-friendly dims (every projection a multiple of 16).

    hidden 128, 4 query heads of 32, 2 kv heads (GQA), SwiGLU ``intermediate_size``, tied
    embeddings; ``vocab_size`` is padded up to a multiple of 16. Token ids follow
    :func:`build_tiny_tokenizer` (pad 0, EOS ``<|end|>``).
    """
    padded = -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    return ModelConfig(
        vocab_size=padded,
        hidden_size=128,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        eos_token_id=SPECIAL_TOKENS.index(EOS_TOKEN),
        pad_token_id=SPECIAL_TOKENS.index(PAD_TOKEN),
    )
