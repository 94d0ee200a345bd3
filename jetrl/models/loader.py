"""Load and save HF-format checkpoints (config.json + safetensors) for ``CausalLM``.

Why: RL runs start from hub checkpoints and must hand results back in the same
format, without depending on the ``transformers`` runtime. Because ``CausalLM`` uses
HF parameter names verbatim, the mapping is the identity; this module only does I/O
and strict validation (every tensor present, every shape equal) so a wrong or partial
checkpoint fails loudly with the name of what is wrong, instead of silently running
with random weights.

Layout handled:
  * ``config.json`` -> ``ModelConfig.from_hf_dict``
  * ``model.safetensors`` (single file), or
  * ``model.safetensors.index.json`` whose ``weight_map`` maps tensor -> shard file.
With tied embeddings HF omits ``lm_head.weight``; we do the same on save and
ignore it (if present) on load. Shards are packed greedily in state-dict order:
a new shard starts when adding a tensor would exceed ``max_shard_bytes``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from jetrl.models.config import ModelConfig
from jetrl.models.llama import CausalLM

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old exports saved; we recompute them
_TIED_KEY = "lm_head.weight"


class CheckpointError(ValueError):
    """A checkpoint directory is missing, malformed, or does not match its config."""


def load_config(path: str | Path) -> ModelConfig:
    cfg_file = Path(path) / CONFIG_NAME
    if not cfg_file.is_file():
        raise CheckpointError(f"{cfg_file} not found; point `path` at an HF model directory containing {CONFIG_NAME}")
    try:
        return ModelConfig.from_hf_dict(json.loads(cfg_file.read_text()))
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{cfg_file}: {e}") from e


def _weight_files(path: Path) -> dict[str, list[str] | None]:
    """Map each weight file to the tensor names it should hold (None: whatever it holds)."""
    index_file = path / INDEX_NAME
    if index_file.is_file():
        weight_map: dict[str, str] = json.loads(index_file.read_text())["weight_map"]
        files: dict[str, list[str]] = {}
        for name, fname in weight_map.items():
            files.setdefault(fname, []).append(name)
        for fname in files:
            if not (path / fname).is_file():
                raise CheckpointError(f"shard {path / fname} listed in {index_file} is missing; re-download it")
        return files
    if (path / WEIGHTS_NAME).is_file():
        return {WEIGHTS_NAME: None}
    raise CheckpointError(
        f"no weights in {path}: expected {WEIGHTS_NAME} or {INDEX_NAME} "
        "(.bin/.pt checkpoints are not supported; convert them to safetensors)"
    )


def _iter_tensors(path: Path, device: str | torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    for fname, names in _weight_files(path).items():
        with safe_open(str(path / fname), framework="pt", device=str(device)) as f:
            available = set(f.keys())
            for name in names if names is not None else sorted(available):
                if name not in available:
                    raise CheckpointError(f"tensor {name!r} is listed in {INDEX_NAME} but absent from {path / fname}")
                yield name, f.get_tensor(name)


def load_pretrained(
    path: str | Path, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu"
) -> tuple[CausalLM, ModelConfig]:
    """Build a ``CausalLM`` from an HF checkpoint directory, cast to ``dtype`` on ``device``."""
    path = Path(path)
    config = load_config(path)
    with torch.device("meta"):
        model = CausalLM(config)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop(_TIED_KEY)

    state: dict[str, torch.Tensor] = {}
    for name, tensor in _iter_tensors(path, device):
        if name.endswith(_IGNORED_SUFFIXES) or (config.tie_word_embeddings and name == _TIED_KEY):
            continue
        if name not in expected:
            raise CheckpointError(
                f"unexpected tensor {name!r} in {path}; the checkpoint does not match {config.architecture} "
                "with this config.json (wrong architecture or layer count?)"
            )
        if tensor.shape != expected[name]:
            raise CheckpointError(
                f"shape mismatch for {name!r}: checkpoint has {tuple(tensor.shape)}, config.json implies "
                f"{tuple(expected[name])}; fix config.json or use the matching checkpoint"
            )
        state[name] = tensor.to(dtype)
    missing = sorted(expected.keys() - state.keys())
    if missing:
        hint = " (set tie_word_embeddings=true if the head is tied)" if missing == [_TIED_KEY] else ""
        raise CheckpointError(f"{path} is missing {len(missing)} tensor(s): {', '.join(missing[:8])}{hint}")

    if config.tie_word_embeddings:
        state[_TIED_KEY] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()  # assign=True replaced both Parameters; re-share them
    return model, config


def save_pretrained(
    model: CausalLM,
    config: ModelConfig,
    out_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = 5 * 10**9,
) -> None:
    """Write ``config.json`` + safetensors (sharded with an index above ``max_shard_bytes``)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(device="cpu", dtype=dtype).contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop(_TIED_KEY, None)

    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and shard_bytes + nbytes > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = t
        shard_bytes += nbytes

    for stale in [*out_dir.glob("model*.safetensors"), out_dir / INDEX_NAME]:
        stale.unlink(missing_ok=True)  # never leave shards of a previous save next to an index that omits them
    meta = {"format": "pt"}  # transformers refuses safetensors files without it
    if len(shards) == 1:
        save_file(shards[0], str(out_dir / WEIGHTS_NAME), metadata=meta)
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out_dir / fname), metadata=meta)
            weight_map.update(dict.fromkeys(shard, fname))
        total = sum(t.numel() * t.element_size() for t in state.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")

    hf = config.to_hf_dict()
    hf["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out_dir / CONFIG_NAME).write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
