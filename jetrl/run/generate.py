"""``jetrl generate``: completions from the rollout engine, for a prompt or a file of prompts.

Prompts go through the tokenizer's chat template unless ``--raw``; a file holds one prompt per
line, or jsonl records with a ``prompt`` (string or chat messages). Output is the completion
text per prompt and sample, or with ``--logprobs`` one JSON object per completion holding the
token ids and the per-token logprobs of the distribution actually sampled from.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from jetrl.data.chat import encode_prompt
from jetrl.data.records import to_messages
from jetrl.engine import Engine, SamplingParams
from jetrl.engine.engine import check_context
from jetrl.models.loader import load_config
from jetrl.models.tokenizer import load_tokenizer
from jetrl.rl.config import TEMPLATE_ARGUMENTS, valid_template_kwargs
from jetrl.run.models import load_model, model_path


def read_prompts(prompts: list[str] | None, prompts_file: str | None) -> list[Any]:
    """Prompt strings (or message lists) from ``--prompt`` and ``--prompts-file``, each checked where it was read (a
    bad line is named by ``file:line``)."""
    out: list[Any] = list(prompts or [])
    if prompts_file is not None:
        path = Path(prompts_file)
        if not path.is_file():
            raise FileNotFoundError(f"prompts file {path} does not exist")
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError as e:
            raise ValueError(f"prompts file {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None
        found = 0
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            if path.suffix == ".jsonl":
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{number}: not valid JSON ({e.msg})") from None
                if not isinstance(record, dict) or "prompt" not in record:
                    raise ValueError(f"{path}:{number}: a jsonl prompt line needs a 'prompt' field")
                try:
                    to_messages(record["prompt"])
                except ValueError as e:
                    raise ValueError(f"{path}:{number}: {e}") from None
                out.append(record["prompt"])
            else:
                out.append(line)
            found += 1
        if not found:
            raise ValueError(f"prompts file {path} holds no prompt (every line is blank)")
    if not out:
        raise ValueError("no prompt given: pass --prompt TEXT (repeatable) or --prompts-file FILE")
    return out


def template_kwargs_from_json(text: str | None) -> dict[str, Any]:
    """``--chat-template-kwargs``: a JSON object of the chat template's keyword arguments (``{}`` when not given),
    checked as ``grpo.chat_template_kwargs`` is."""
    if text is None:
        return {}
    try:
        kwargs = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--chat-template-kwargs {text!r} is not valid JSON ({e.msg}); e.g. "
                         "'{\"enable_thinking\": false}'") from None
    if not valid_template_kwargs(kwargs):
        raise ValueError(f"--chat-template-kwargs {text!r} must be a JSON object of keyword arguments, none of "
                         f"{sorted(TEMPLATE_ARGUMENTS)} (jetrl sets those)")
    return kwargs


def encode_prompts(tokenizer: Any, prompts: list[Any], raw: bool = False,
                   template_kwargs: dict[str, Any] | None = None) -> list[list[int]]:
    """Token ids of each prompt: through the tokenizer's chat template (with ``template_kwargs``), or (``raw``) its
    text encoded as is."""
    if raw:  # the text of a string, or of a message list's last message
        if template_kwargs:
            raise ValueError("--chat-template-kwargs has no effect with --raw (no chat template is applied); drop one")
        return [tokenizer.encode(p if isinstance(p, str) else to_messages(p)[-1]["content"]) for p in prompts]
    return [encode_prompt(to_messages(p), tokenizer, template_kwargs=template_kwargs) for p in prompts]


def generate_main(model: str, prompts: list[Any], *, recipe: str = "jet", dtype: str = "float32", n: int = 1,
                  temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, max_tokens: int = 128,
                  seed: int = 0, stop: list[str] | None = None, raw: bool = False, logprobs: bool = False,
                  device: str | None = None, template_kwargs: dict[str, Any] | None = None) -> list[list[Any]]:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    params = SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                            seed=seed, stop=tuple(stop or ()))
    # the prompts and the model's context are checked before its weights load (the tokenizer and config.json only)
    path = model_path(model)
    prompt_ids = encode_prompts(load_tokenizer(path), prompts, raw, template_kwargs)
    max_len = max(len(p) for p in prompt_ids) + max_tokens + 1
    check_context(prompt_ids, max_tokens, max_len, load_config(path).max_position_embeddings)
    net, tokenizer, _ = load_model(str(path), dtype, recipe=recipe, device=device)
    engine = Engine(net, tokenizer, max_slots=max(n, min(64, n * len(prompt_ids))), max_len=max_len)
    groups = engine.generate(prompt_ids, params)
    for i, group in enumerate(groups):
        for j, completion in enumerate(group):
            if logprobs:
                print(json.dumps({"prompt_index": i, "sample_index": j, "text": completion.text,
                                  "token_ids": completion.token_ids, "logprobs": completion.logprobs,
                                  "finish_reason": completion.finish_reason}))
            else:
                header = f"[{i}]" if n == 1 else f"[{i}.{j}]"
                print(f"{header} {completion.text}")
    return groups
