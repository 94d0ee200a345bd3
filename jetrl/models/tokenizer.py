"""The tokenizer of a checkpoint directory, with its chat template and stop tokens.

Why a wrapper: the RL loop needs four things from a tokenizer and nothing else -- prompt ids
from chat messages (with the assistant's generation prompt), text from sampled ids, the
token ids that end a completion, and a pad id -- and it must get them from the files next
to the weights, offline. ``load_tokenizer(dir)`` reads ``tokenizer.json`` /
``tokenizer_config.json`` (+ ``chat_template.jinja``) with transformers' ``AutoTokenizer``
and ``local_files_only=True``, so nothing is ever fetched from a hub.

Conventions:

* ``encode`` never adds special tokens (a chat template writes its own BOS/role markers);
* ``apply_chat_template(messages)`` renders the template to text, then encodes it, so the
  ids are exactly ``encode(chat_prompt(messages))``;
* ``stop_token_ids`` is the tokenizer's EOS plus every ``eos_token_id`` listed in the
  directory's ``generation_config.json`` / ``config.json`` (instruct models often stop on
  more than one token), in that order, without duplicates;
* ``pad_token_id`` is the tokenizer's pad token; if it has none, EOS is used and
  ``pad_is_eos`` is True (code that masks by ``ids != pad`` must then use attention masks
  instead, or it would mask the EOS the policy has to learn to emit).

transformers (a dependency of jetrl, for its tokenizers and chat templates only) is imported only
when a tokenizer is loaded.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jetrl.models.loader import CheckpointError

# Files that make up a tokenizer directory (any subset); export copies these along.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
)
_REQUIRED_ANY = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

Message = dict[str, str]


class TokenizerError(CheckpointError):
    """The directory holds no usable tokenizer (or transformers is missing)."""


class Tokenizer:
    """A thin, typed view of an HF tokenizer; ``.hf`` is the underlying transformers object."""

    def __init__(self, hf: Any, stop_token_ids: Sequence[int] = (), source: str | Path | None = None) -> None:
        if hf.eos_token_id is None:
            raise TokenizerError(f"tokenizer from {source} has no eos_token; set one in tokenizer_config.json")
        self.hf = hf
        self.source = Path(source) if source is not None else None
        self.pad_is_eos = hf.pad_token_id is None
        stops = [hf.eos_token_id, *stop_token_ids]
        self.stop_token_ids: list[int] = list(dict.fromkeys(int(t) for t in stops))

    # ----------------------------------------------------------------- ids
    @property
    def eos_token_id(self) -> int:
        return int(self.hf.eos_token_id)

    @property
    def pad_token_id(self) -> int:
        return self.eos_token_id if self.pad_is_eos else int(self.hf.pad_token_id)

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce (base vocab + added tokens)."""
        return len(self.hf)

    @property
    def chat_template(self) -> str | None:
        return getattr(self.hf, "chat_template", None) or None

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    # ----------------------------------------------------------------- text <-> ids
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; no special tokens are added."""
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def chat_prompt(self, messages: Sequence[Message], add_generation_prompt: bool = True, **template_kwargs) -> str:
        """The chat template rendered to text (with the assistant's turn opened by default).

        ``template_kwargs`` reach the template (e.g. ``enable_thinking=False`` for Qwen3).
        """
        if not self.has_chat_template:
            raise TokenizerError(
                f"tokenizer from {self.source} has no chat template; add chat_template.jinja or a "
                "'chat_template' entry in tokenizer_config.json, or build prompts with encode()"
            )
        return self.hf.apply_chat_template(
            [dict(m) for m in messages], tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
        )

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        *,
        tokenize: bool = True,
        return_dict: bool = False,
        **template_kwargs,
    ) -> list[int] | str | dict[str, list[int]]:
        """Prompt ids for ``messages`` (list of {"role", "content"}), ready for generation.

        Same call shape as transformers' (``tokenize=False`` gives the text, ``return_dict=True``
        a dict with ``input_ids``), so code written against an HF tokenizer takes this one too.
        """
        text = self.chat_prompt(messages, add_generation_prompt, **template_kwargs)
        if not tokenize:
            return text
        ids = self.encode(text)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)} if return_dict else ids

    def is_stop(self, token_id: int) -> bool:
        return int(token_id) in self.stop_token_ids

    def save(self, out_dir: str | Path) -> None:
        """Write the tokenizer files (and chat template) into ``out_dir``, and the source's
        ``generation_config.json``: its ``eos_token_id`` list is part of ``stop_token_ids`` (instruct models stop
        on several ids), which ``load_tokenizer`` of ``out_dir`` must read back -- a training checkpoint is
        evaluated, resumed and exported from."""
        self.hf.save_pretrained(str(out_dir))
        if self.source is not None:
            src, dst = self.source / "generation_config.json", Path(out_dir) / "generation_config.json"
            if src.is_file() and src.resolve() != dst.resolve():
                shutil.copyfile(src, dst)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(source={str(self.source)!r}, vocab_size={self.vocab_size}, eos={self.hf.eos_token!r}, "
            f"pad={self.hf.pad_token if not self.pad_is_eos else self.hf.eos_token!r}, stop_token_ids={self.stop_token_ids})"
        )


def has_tokenizer(path: str | Path) -> bool:
    path = Path(path)
    return any((path / f).is_file() for f in _REQUIRED_ANY)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer stored in checkpoint directory ``path`` (offline; see the module docstring)."""
    path = Path(path)
    if not path.is_dir():
        raise TokenizerError(f"{path} is not a directory; point at a checkpoint directory that holds tokenizer.json")
    if not has_tokenizer(path):
        raise TokenizerError(
            f"no tokenizer in {path}: expected tokenizer.json or tokenizer_config.json; copy the base model's "
            "tokenizer files into it (jetrl export and jetrl convert-smollm2 write them)"
        )
    try:
        from transformers import AutoTokenizer
    except ImportError as e:  # pragma: no cover - depends on the install
        raise TokenizerError("loading a tokenizer needs transformers, a dependency of jetrl that is missing "
                             "here: pip install 'transformers>=5.0'") from e
    try:
        hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise TokenizerError(f"cannot load the tokenizer in {path}: {e}") from e
    return Tokenizer(hf, _config_eos_ids(path), source=path)


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy the tokenizer files (and generation_config.json) of ``src`` into ``dst``; returns the names copied."""
    src, dst = Path(src), Path(dst)
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file() and (src / name).resolve() != (dst / name).resolve():
            shutil.copyfile(src / name, dst / name)
            copied.append(name)
    return copied


def _config_eos_ids(path: Path) -> list[int]:
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        f = path / name
        if not f.is_file():
            continue
        try:
            eos = json.loads(f.read_text()).get("eos_token_id")
        except (ValueError, AttributeError):
            continue
        if isinstance(eos, int):
            ids.append(eos)
        elif isinstance(eos, list):
            ids.extend(int(t) for t in eos if isinstance(t, int))
    return ids
