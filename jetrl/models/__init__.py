"""Decoder model family (Llama, Qwen2, Qwen3) and its HF checkpoint I/O.

Why: one pure-PyTorch model whose parameter names equal HF ``transformers`` names, so a
hub checkpoint loads with an identity name map and every projection is a swappable
``nn.Linear`` (see ``llama.py`` for the math, ``loader.py`` for the file formats).
"""

from jetrl.models.config import ModelConfig
from jetrl.models.llama import CausalLM
from jetrl.models.loader import CheckpointError, load_pretrained, save_pretrained
from jetrl.models.tokenizer import Tokenizer, TokenizerError, load_tokenizer

__all__ = [
    "CausalLM",
    "CheckpointError",
    "ModelConfig",
    "Tokenizer",
    "TokenizerError",
    "load_pretrained",
    "load_tokenizer",
    "save_pretrained",
]
