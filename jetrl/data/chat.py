"""Prompt records -> prompt token ids through the tokenizer's chat template.

Why the template and not string concatenation: an instruct model is only on-distribution in
the exact format it was tuned on (role tags, BOS, the assistant header that
``add_generation_prompt=True`` appends), and the template is the one source of that format.
The ids come from ``apply_chat_template(..., tokenize=True)`` so special tokens are added
exactly once, as the template says. An optional system prompt is prepended unless the record
already starts with its own system message (the record's wins).

``check_prompt_lengths`` fails early, naming the record, when a prompt exceeds
``max_prompt_length``: a prompt that does not fit would otherwise be truncated silently or
crash the engine mid-run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from jetrl.data.records import Message, Record, to_messages


class PromptTooLongError(ValueError):
    """A prompt is longer than the configured maximum prompt length."""


def with_system_prompt(messages: list[Message], system_prompt: str | None) -> list[Message]:
    """``messages`` with ``system_prompt`` first, unless it is None or a system message is there."""
    if system_prompt is None or (messages and messages[0]["role"] == "system"):
        return messages
    return [{"role": "system", "content": system_prompt}, *messages]


def encode_prompt(messages: list[Message], tokenizer: Any, *, system_prompt: str | None = None,
                  template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of the chat-formatted prompt, ending with the assistant generation header. ``template_kwargs``
    reach the template (``grpo.chat_template_kwargs``, e.g. ``enable_thinking=False`` for Qwen3)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"{type(tokenizer).__name__} has no chat_template: use an instruct/chat tokenizer "
                         "or set tokenizer.chat_template to a Jinja template")
    with _template_errors(template_kwargs):
        ids = tokenizer.apply_chat_template(with_system_prompt(messages, system_prompt), add_generation_prompt=True,
                                            tokenize=True, return_dict=False, **(template_kwargs or {}))
    return list(ids)


@contextlib.contextmanager
def _template_errors(template_kwargs: dict[str, Any] | None) -> Iterator[None]:
    """A chat template that fails (Jinja's own errors, or the template's ``raise_exception``) as one ValueError
    naming the keyword arguments it was given, not a traceback from inside Jinja."""
    try:
        yield
    except Exception as e:
        if type(e).__module__.split(".")[0] != "jinja2" and not isinstance(e, TypeError):
            raise  # jetrl's own errors (no template, a bad message) already read as one line
        given = f" with chat_template_kwargs={template_kwargs}" if template_kwargs else ""
        raise ValueError(f"the tokenizer's chat template failed{given}: {type(e).__name__}: {e}") from None


def check_prompt_lengths(prompt_ids: Sequence[Sequence[int]], max_prompt_length: int) -> None:
    """Raise ``PromptTooLongError`` naming the first prompt longer than ``max_prompt_length`` tokens."""
    for i, ids in enumerate(prompt_ids):
        if len(ids) > max_prompt_length:
            raise PromptTooLongError(f"prompt of record {i} is {len(ids)} tokens, longer than max_prompt_length="
                                     f"{max_prompt_length}: raise max_prompt_length or drop/shorten that record")


def encode_prompts(records: Sequence[Record], tokenizer: Any, *, system_prompt: str | None = None,
                   max_prompt_length: int | None = None,
                   template_kwargs: dict[str, Any] | None = None) -> list[list[int]]:
    """Prompt ids of every record; checked against ``max_prompt_length`` when it is given. A record's prompt
    may be chat messages or a plain string (TRL's standard format), as the dataset loader takes it."""
    prompt_ids = [encode_prompt(to_messages(r["prompt"]), tokenizer, system_prompt=system_prompt,
                                template_kwargs=template_kwargs) for r in records]
    if max_prompt_length is not None:
        check_prompt_lengths(prompt_ids, max_prompt_length)
    return prompt_ids
