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

FP8 checkpoints (config.json ``quantization_config.quant_method == "fp8"``, the
fine-grained format :mod:`jetrl.models.export` writes: ``<layer>.weight`` F8_E4M3 +
``<layer>.weight_scale_inv`` fp32 per 128x128 block) load into a model converted with a
precision recipe (default ``jet``): exactly the layers that hold FP8 codes in the file
become ``Float8Linear``, their master weights are set to ``codes * scales`` (in ``dtype``),
and each layer's weight cache is *primed* with the file's codes and scales
(:meth:`~jetrl.fp8.weight_cache.WeightCache.prime`), so the loaded model computes with the
very bits that were exported, not with a re-quantization of the dequantized master (which
is not guaranteed to reproduce them). Load on the device you will run on: moving the model
afterwards changes the weights' storage, which invalidates the primed caches.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from jetrl.models.config import ModelConfig
from jetrl.models.llama import CausalLM

if TYPE_CHECKING:
    from jetrl.fp8.recipe import Recipe

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old exports saved; we recompute them
_TIED_KEY = "lm_head.weight"


class CheckpointError(ValueError):
    """A checkpoint directory is missing, malformed, or does not match its config."""


def load_config(path: str | Path) -> ModelConfig:
    return _config_from(path, _read_config(path))


def _read_config(path: str | Path) -> tuple[Path, dict[str, Any]]:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory; point at an HF model directory containing {CONFIG_NAME}")
    cfg_file = path / CONFIG_NAME
    if not cfg_file.is_file():
        raise CheckpointError(f"{cfg_file} not found; point `path` at an HF model directory containing {CONFIG_NAME}")
    try:
        return cfg_file, json.loads(cfg_file.read_text())
    except ValueError as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON: {e}") from e


def _config_from(path: str | Path, read: tuple[Path, dict[str, Any]]) -> ModelConfig:
    cfg_file, raw = read
    if not isinstance(raw, dict):
        raise CheckpointError(f"{cfg_file} must hold a JSON object (the model's config), got {type(raw).__name__}")
    try:
        return ModelConfig.from_hf_dict(raw)
    except KeyError as e:
        raise CheckpointError(f"{cfg_file} has no {e.args[0]!r}, which an HF config of this architecture needs; "
                              "restore the model's own config.json") from e
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{cfg_file}: {e}") from e


def read_fp8_quantization_config(path: str | Path) -> dict[str, Any] | None:
    """The validated fine-grained FP8 ``quantization_config`` of checkpoint ``path``, or None if it has none."""
    cfg_file, raw = _read_config(path)
    return _fp8_quantization(cfg_file, raw)


def _fp8_quantization(cfg_file: Path, raw: dict[str, Any]) -> dict[str, Any] | None:
    qc = raw.get("quantization_config")
    if qc is None:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method != "fp8":
        raise CheckpointError(
            f"{cfg_file}: quantization_config.quant_method={qc.get('quant_method')!r} is not supported; "
            "jetrl loads unquantized checkpoints and fine-grained FP8 ('fp8') ones"
        )
    problems = []
    if list(qc.get("weight_block_size") or []) != [128, 128]:
        problems.append(f"weight_block_size={qc.get('weight_block_size')!r} (need [128, 128])")
    if str(qc.get("fmt", "e4m3")).lower() != "e4m3":
        problems.append(f"fmt={qc.get('fmt')!r} (need 'e4m3')")
    if str(qc.get("activation_scheme", "dynamic")).lower() != "dynamic":
        problems.append(f"activation_scheme={qc.get('activation_scheme')!r} (need 'dynamic')")
    if qc.get("scale_fmt", "float") != "float":
        problems.append(f"scale_fmt={qc.get('scale_fmt')!r} (need 'float': fp32 weight_scale_inv)")
    if problems:
        raise CheckpointError(f"{cfg_file}: unsupported FP8 quantization_config: {', '.join(problems)}")
    return qc


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
        try:
            handle = safe_open(str(path / fname), framework="pt", device=str(device))
        except Exception as err:  # safetensors raises its own error type for a damaged file
            raise CheckpointError(f"{path / fname} cannot be read ({type(err).__name__}: {err}): the file is "
                                  "damaged or truncated; write it again (jetrl export, a training checkpoint) or "
                                  "use another checkpoint") from err
        with handle as f:
            available = set(f.keys())
            for name in names if names is not None else sorted(available):
                if name not in available:
                    raise CheckpointError(f"tensor {name!r} is listed in {INDEX_NAME} but absent from {path / fname}")
                yield name, f.get_tensor(name)


def load_pretrained(
    path: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    *,
    recipe: str | Recipe | None = None,
) -> tuple[CausalLM, ModelConfig]:
    """Build a ``CausalLM`` from an HF checkpoint directory, cast to ``dtype`` on ``device``.

    ``recipe`` (a name or a :class:`~jetrl.fp8.recipe.Recipe`): when given, the model is
    converted with it (:func:`jetrl.fp8.convert_to_float8`) before it is returned. An FP8
    checkpoint is always converted (default recipe ``jet``) and its weight caches primed with
    the file's codes (module docstring); ``recipe="bf16"`` loads it as plain dequantized weights.
    """
    path = Path(path)
    read = _read_config(path)
    config = _config_from(path, read)
    fp8_config = _fp8_quantization(*read)
    with torch.device("meta"):
        model = CausalLM(config)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop(_TIED_KEY)
    linear_names = {fqn for fqn, m in model.named_modules() if isinstance(m, torch.nn.Linear)}

    state: dict[str, torch.Tensor] = {}
    fp8_codes: dict[str, torch.Tensor] = {}  # layer fqn -> F8 codes
    fp8_scales: dict[str, torch.Tensor] = {}  # layer fqn -> fp32 weight_scale_inv
    for name, tensor in _iter_tensors(path, device):
        if name.endswith(_IGNORED_SUFFIXES) or (config.tie_word_embeddings and name == _TIED_KEY):
            continue
        fqn, _, leaf = name.rpartition(".")
        if fp8_config is not None and leaf == "weight_scale_inv" and fqn in linear_names:
            fp8_scales[fqn] = tensor
            continue
        if fp8_config is not None and tensor.dtype == torch.float8_e4m3fn and leaf == "weight" and fqn in linear_names:
            if tensor.shape != expected[name]:
                raise CheckpointError(
                    f"shape mismatch for {name!r}: checkpoint has {tuple(tensor.shape)}, config.json implies "
                    f"{tuple(expected[name])}; fix config.json or use the matching checkpoint"
                )
            fp8_codes[fqn] = tensor
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
        if not tensor.is_floating_point() or tensor.element_size() < 2:
            raise CheckpointError(
                f"tensor {name!r} in {path} has dtype {tensor.dtype}; expected a float16/bfloat16/float32 tensor"
                + ("" if fp8_config else " (FP8 weights need an fp8 quantization_config in config.json)")
            )
        state[name] = tensor.to(dtype)

    quantized = _dequantize_fp8(path, fp8_codes, fp8_scales, state, dtype)
    missing = sorted(expected.keys() - state.keys())
    if missing:
        hint = " (set tie_word_embeddings=true if the head is tied)" if missing == [_TIED_KEY] else ""
        raise CheckpointError(f"{path} is missing {len(missing)} tensor(s): {', '.join(missing[:8])}{hint}")

    if config.tie_word_embeddings:
        state[_TIED_KEY] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()  # assign=True replaced both Parameters; re-share them
    if fp8_config is not None and recipe is None:
        recipe = fp8_config.get("jetrl_recipe") or "jet"  # the recipe the codes were exported under
    if recipe is not None:
        _convert_and_prime(model, recipe, quantized)
    return model, config


def recipe_from_name(name: str) -> Recipe:
    """A name of ``RECIPE_NAMES`` (``"jet"``, ``"jet_kv"``, ...), or its ``"+pow2"`` variant (as
    ``Recipe.name`` spells it)."""
    from jetrl.fp8.recipe import RECIPE_NAMES, get_recipe

    base, _, suffix = name.partition("+")
    if suffix not in ("", "pow2"):
        raise ValueError(f"unknown recipe {name!r}; use one of {', '.join(RECIPE_NAMES)}, optionally with '+pow2'")
    return get_recipe(base, pow2_scale=suffix == "pow2")


SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # weight_scale_inv dtypes read (as transformers, vLLM)


def _dequantize_fp8(
    path: Path,
    codes: dict[str, torch.Tensor],
    scales: dict[str, torch.Tensor],
    state: dict[str, torch.Tensor],
    dtype: torch.dtype,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Put ``codes * scales`` (in ``dtype``) into ``state``; return {layer fqn: (codes, scales)}."""
    from jetrl.fp8.quant import BLOCK, Float8Blocks

    unpaired = sorted(codes.keys() ^ scales.keys())
    if unpaired:
        fqn = unpaired[0]
        has = "weight_scale_inv without an F8_E4M3 weight" if fqn in scales else "F8_E4M3 weight without weight_scale_inv"
        raise CheckpointError(f"{path}: layer {fqn!r} has {has} ({len(unpaired)} such layers); the FP8 checkpoint is incomplete")
    out = {}
    for fqn, q in codes.items():
        s = scales[fqn]
        grid = (-(-q.shape[0] // BLOCK), -(-q.shape[1] // BLOCK))
        if s.dtype not in SCALE_DTYPES or tuple(s.shape) != grid:
            raise CheckpointError(
                f"{path}: {fqn}.weight_scale_inv is {s.dtype} {tuple(s.shape)}; a {tuple(q.shape)} weight in "
                f"128x128 blocks needs float32 (or bfloat16 / float16) {grid}"
            )
        s = s.float()  # hub checkpoints (Qwen3-*-FP8) store bf16 scales; every bf16 / fp16 value is an exact fp32
        state[f"{fqn}.weight"] = Float8Blocks(q, s, (BLOCK, BLOCK)).dequantize(dtype)
        out[fqn] = (q, s)
    return out


def _convert_and_prime(
    model: CausalLM, recipe: str | Recipe, quantized: dict[str, tuple[torch.Tensor, torch.Tensor]]
) -> None:
    """Convert ``model`` with ``recipe``; FP8 layers of the file become Float8Linear with primed caches."""
    from jetrl.fp8.convert import convert_to_float8, default_module_filter, float8_modules
    from jetrl.fp8.quant import Float8Blocks

    recipe = recipe_from_name(recipe) if isinstance(recipe, str) else recipe
    if quantized:
        # Exactly the layers the file quantized: the loaded model computes what the file says.
        convert_to_float8(model, recipe, module_filter=lambda m, fqn: fqn in quantized)
    else:
        convert_to_float8(model, recipe, module_filter=default_module_filter)
    spec = recipe.rollout.weight or recipe.train.weight
    if spec is None:
        return  # a BF16 recipe computes from the dequantized master weights
    for fqn, module in float8_modules(model).items():
        if fqn in quantized:
            codes, scales = quantized[fqn]
            module.weight_cache.prime(module.weight, spec, Float8Blocks(codes, scales, spec.block))


def save_pretrained(
    model: CausalLM,
    config: ModelConfig,
    out_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = 5 * 10**9,
    replace: dict[str, torch.Tensor] | None = None,
) -> None:
    """Write ``config.json`` + safetensors (sharded with an index above ``max_shard_bytes``). ``replace``: tensors
    written instead of the model's own of the same names (the whole weights of a data-parallel shard)."""
    state = {k: v.detach().to(device="cpu", dtype=dtype).contiguous()
             for k, v in {**model.state_dict(), **(replace or {})}.items()}
    if config.tie_word_embeddings:
        state.pop(_TIED_KEY, None)
    hf = config.to_hf_dict()
    hf["torch_dtype"] = str(dtype).removeprefix("torch.")
    save_state_dict(state, hf, out_dir, max_shard_bytes)


def save_state_dict(
    state: dict[str, torch.Tensor], hf_config: dict[str, Any], out_dir: str | Path, max_shard_bytes: int = 5 * 10**9
) -> None:
    """Write ``state`` (CPU tensors, any dtypes, saved as given) as safetensors shards + ``config.json``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in state.items()}
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
    (out_dir / CONFIG_NAME).write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
