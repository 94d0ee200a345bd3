"""Export a model as an HF checkpoint directory: BF16, or fine-grained FP8 with the trainer's codes.

Command line (``jetrl export``)::

    jetrl export --run RUN_DIR_OR_CHECKPOINT --format bf16 --out DIR
    jetrl export --run RUN_DIR_OR_CHECKPOINT --format fp8  --out DIR [--recipe jet]

Formats:

* ``bf16``: ``config.json`` + ``model.safetensors`` (sharded above 5 GB), every tensor BF16.
* ``fp8``: the fine-grained FP8 layout that transformers (``FineGrainedFP8Config``) and vLLM
  (``Fp8Config``) read, as DeepSeek-V3 ships it. ``config.json`` gains::

      "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                              "weight_block_size": [128, 128],
                              "modules_to_not_convert": ["lm_head", ...],   # nn.Linear kept BF16
                              "ignored_layers": ["lm_head", ...],           # the same, for older vLLM
                              "jetrl_recipe": "jet"}                        # ignored by other readers

  each FP8 linear layer stores ``<layer>.weight`` as F8_E4M3 and ``<layer>.weight_scale_inv`` as
  fp32 of shape (ceil(out/128), ceil(in/128)) with ``W ~= weight * weight_scale_inv`` per block;
  embeddings, norms, ``lm_head`` and biases are BF16. The codes are read from each layer's
  quantize-once cache (:func:`jetrl.fp8.export.fp8_state_dict`), i.e. they are the very codes the
  trainer's forward and the rollout used; loading the export back
  (:func:`jetrl.models.load_pretrained`) primes the caches with them again, so FP8 -> load ->
  FP8 is bit-exact. ``modules_to_not_convert`` is written explicitly because transformers adds
  no default skips (not even ``lm_head``) once the list is given. A weight dim of more than 128
  that is not a multiple of 128 ends in a partial block: stored exactly, but transformers' CPU
  dequantization (5.17) takes the block size as ``dim // n_blocks`` and misreads it, so the export
  warns (and counts such layers in its summary). vLLM merges q/k/v and gate/up into one layer and
  requires each member's output size to be a multiple of 128: where one is not (the tiny model's
  64-wide k/v, SmolLM2's 192) the export warns that vLLM will not load it (``vllm_unmergeable_layers``).

The tokenizer files of the source (``tokenizer.json``, ``tokenizer_config.json``,
``chat_template.jinja``, ``generation_config.json``, ...) are copied along.

``--run`` accepts, in this order (:func:`resolve_checkpoint`):

1. a checkpoint directory: it holds ``config.json`` (HF layout, BF16/fp32 or FP8);
2. a run directory with ``checkpoints/latest``: a symlink to a checkpoint directory, or a text
   file holding the name of one under ``checkpoints/``;
3. a run directory with ``checkpoints/step_<N>/`` checkpoint directories: the largest ``N``.

That is the contract for the trainer: it writes each checkpoint as an HF-format directory
``RUN_DIR/checkpoints/step_<N>/`` (via :func:`export_model` or ``save_pretrained`` + the
tokenizer files) and points ``checkpoints/latest`` at the newest one.

Precision of the source: a BF16/fp32 checkpoint is loaded in its stored dtype (the master
weights a trainer would have had), so an FP8 export of it quantizes exactly what the trainer's
weight cache would have quantized; an FP8 checkpoint is loaded with its codes primed.
"""

from __future__ import annotations

import json
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from jetrl.fp8.convert import check_model_precision, convert_to_float8, float8_modules
from jetrl.fp8.export import fp8_quantization_config, fp8_state_dict, high_precision_linears
from jetrl.fp8.quant import BLOCK
from jetrl.fp8.recipe import Recipe, get_recipe
from jetrl.models.config import ModelConfig
from jetrl.models.llama import CausalLM
from jetrl.models.loader import (
    CONFIG_NAME,
    CheckpointError,
    load_pretrained,
    read_fp8_quantization_config,
    recipe_from_name,
    save_pretrained,
    save_state_dict,
)
from jetrl.models.tokenizer import copy_tokenizer_files

FORMATS = ("bf16", "fp8")
_STEP_DIR = re.compile(r"^step[_-]?(\d+)$")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float32}


def resolve_checkpoint(run: str | Path) -> Path:
    """The checkpoint directory that ``run`` designates (see the module docstring for the order)."""
    run = Path(run)
    if not run.exists():
        raise CheckpointError(
            f"{run} does not exist; pass a checkpoint directory (with {CONFIG_NAME}) or a run directory "
            "(with checkpoints/latest)"
        )
    if not run.is_dir():
        raise CheckpointError(f"{run} is a file; pass a checkpoint directory (with {CONFIG_NAME}) or a run directory")
    if (run / CONFIG_NAME).is_file():
        return run
    ckpts = run / "checkpoints"
    latest = ckpts / "latest"
    if latest.is_dir():
        target = latest.resolve()
    elif latest.is_file():
        target = ckpts / latest.read_text().strip()
    else:
        steps = [(int(m.group(1)), d) for d in ckpts.glob("*") if d.is_dir() and (m := _STEP_DIR.match(d.name))]
        if not steps:
            raise CheckpointError(
                f"{run} is neither a checkpoint directory (no {CONFIG_NAME}) nor a run directory (no "
                "checkpoints/latest or checkpoints/step_<N>/); point at one of those"
            )
        target = max(steps)[1]
    if not (target / CONFIG_NAME).is_file():
        raise CheckpointError(f"{run}: the latest checkpoint {target} has no {CONFIG_NAME}; it is incomplete")
    return target


def export_model(
    model: CausalLM,
    config: ModelConfig,
    out_dir: str | Path,
    fmt: str,
    *,
    recipe: str | Recipe | None = None,
    tokenizer_from: str | Path | None = None,
) -> dict[str, Any]:
    """Write ``model`` to ``out_dir`` in ``fmt`` ("bf16" or "fp8"); returns a summary dict.

    For ``fp8`` the FP8 layers are read from their weight caches. A model with no FP8 layers is
    converted *in place* with ``recipe`` (default ``jet``) first; a converted model must carry
    ``recipe`` if one is given. ``tokenizer_from``: a directory whose tokenizer files to copy.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    out_dir = Path(out_dir)
    if isinstance(recipe, str):
        recipe = recipe_from_name(recipe)
    summary: dict[str, Any] = {"format": fmt, "out": str(out_dir)}
    if fmt == "bf16":
        save_pretrained(model, config, out_dir, dtype=torch.bfloat16)
        summary.update(fp8_layers=0)
    else:
        layers = float8_modules(model)
        if not layers:
            recipe = recipe or get_recipe("jet")
            if not (recipe.rollout.is_fp8 or recipe.train.is_fp8):
                raise ValueError(f"recipe {recipe.name!r} has no FP8 weights; export with --format bf16")
            convert_to_float8(model, recipe)
            layers = float8_modules(model)
        model_recipe = next(iter(layers.values())).recipe
        check_model_precision(model, recipe or model_recipe)
        state = fp8_state_dict(model, hp_dtype=torch.bfloat16)
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        qc = fp8_quantization_config(model_recipe, high_precision_linears(model))
        qc["jetrl_recipe"] = model_recipe.name
        hf = config.to_hf_dict()
        hf["torch_dtype"] = "bfloat16"
        hf["quantization_config"] = qc
        save_state_dict(state, hf, out_dir)
        # a dim of more than one block that is not a multiple of 128 ends in a partial block
        partial = [fqn for fqn, m in layers.items() if any(d > BLOCK and d % BLOCK for d in m.weight.shape)]
        if partial:
            warnings.warn(
                f"{len(partial)} FP8 layer(s) end in partial 128x128 blocks (e.g. {partial[0]}, weight "
                f"{tuple(layers[partial[0]].weight.shape)}): the file stores them exactly and jetrl loads them "
                "bit for bit, but transformers' CPU dequantization (5.x) derives the block size as dim // n_blocks "
                "and misreads or rejects them; use --format bf16 for such a model if transformers on CPU must read it",
                stacklevel=2,
            )
        merged = _vllm_unmergeable(layers)
        if merged:
            warnings.warn(
                f"{len(merged)} FP8 layer(s) that vLLM loads merged with their siblings (q/k/v, gate/up) have an "
                f"output size that is not a multiple of 128 (e.g. {merged[0]}, weight "
                f"{tuple(layers[merged[0]].weight.shape)}): vLLM's block-FP8 loader refuses such a merged layer, or "
                "mis-places its per-block scales; jetrl and transformers load the file. Export with --format bf16 "
                "for vLLM (models whose head and MLP sizes are multiples of 128, Qwen3's and Llama's, are fine)",
                stacklevel=2,
            )
        summary.update(fp8_layers=sum(1 for k in state if k.endswith(".weight_scale_inv")), recipe=model_recipe.name,
                       partial_block_layers=len(partial), vllm_unmergeable_layers=len(merged))
    summary["tokenizer_files"] = copy_tokenizer_files(tokenizer_from, out_dir) if tokenizer_from else []
    return summary


VLLM_MERGED = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # vLLM's QKVParallelLinear, MergedColumn...


def _vllm_unmergeable(layers: dict) -> list[str]:
    """FP8 layers vLLM merges with siblings (q/k/v, gate/up) whose output size is not a multiple of 128: its
    ``Fp8LinearMethod.create_weights`` requires every partition of a merged block-FP8 layer to be."""
    return [fqn for fqn, m in layers.items()
            if fqn.rsplit(".", 1)[-1] in VLLM_MERGED and m.weight.shape[0] % BLOCK]


def unwritable(path: Path) -> str | None:
    """Why a directory at ``path`` could not be written -- tried in it, or before it exists in its nearest existing
    parent, with a temporary file and no directory made -- or None."""
    where = next(p for p in [path, *path.parents] if p.exists())
    if not where.is_dir():
        return f"{where} is a file"
    try:
        tempfile.TemporaryFile(dir=where).close()
    except OSError as e:
        return f"{e.strerror} in {where}"
    return None


def export_checkpoint(
    run: str | Path, out_dir: str | Path, fmt: str, *, recipe: str | None = None, device: str = "cpu"
) -> dict[str, Any]:
    """Load the checkpoint ``run`` designates and export it to ``out_dir`` (the ``jetrl export`` command)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown --format {fmt!r}; choose one of {', '.join(FORMATS)}")
    src = resolve_checkpoint(run)
    out_dir = Path(out_dir)
    if out_dir.exists() and out_dir.resolve() == src.resolve():
        raise CheckpointError(f"--out {out_dir} is the source checkpoint; export into another directory")
    if out_dir.exists() and not out_dir.is_dir():
        raise CheckpointError(f"--out {out_dir} is a file; pass a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()):  # a training checkpoint, a run dir, an earlier export: not ours
        raise CheckpointError(f"--out {out_dir} is not empty; export into a new or empty directory (delete {out_dir} "
                              "first to replace what it holds)")
    fp8_src = read_fp8_quantization_config(src)
    if recipe is None and fp8_src is not None and fp8_src.get("jetrl_recipe"):
        recipe = fp8_src["jetrl_recipe"]  # re-export with the recipe the codes were made under
    recipe_obj = recipe_from_name(recipe) if recipe else None
    load_recipe = recipe_obj if fmt == "fp8" or fp8_src is not None else None
    if fmt == "fp8" and load_recipe is None:
        load_recipe = get_recipe("jet")
    problem = unwritable(out_dir)  # before the model loads: a path that cannot be written fails at once
    if problem:
        raise CheckpointError(f"--out {out_dir} cannot be written ({problem}); pass a writable directory")
    model, config = load_pretrained(src, dtype=_stored_dtype(src), device=device, recipe=load_recipe)
    summary = export_model(model, config, out_dir, fmt, recipe=load_recipe if fmt == "fp8" else None,
                           tokenizer_from=src)
    summary["source"] = str(src)
    return summary


def _stored_dtype(path: Path) -> torch.dtype:
    raw = json.loads((path / CONFIG_NAME).read_text())
    if raw.get("quantization_config") is not None:
        return torch.bfloat16  # the non-FP8 tensors of an FP8 export are BF16
    name = raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"
    return _DTYPES.get(str(name).removeprefix("torch."), torch.bfloat16)
