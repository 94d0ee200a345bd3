"""The record schema every task generator and dataset loader produces.

Why one schema: the trainer, the eval loop and the reward functions should not care whether a
problem came from reasoning-gym, the synthetic generator or a user's verl parquet. A record is

    {"prompt": [{"role": "user", "content": "What is 23 + 58?"}, ...],   # chat messages
     "ground_truth": "81",                                                # gold answer, a str (*)
     "task": "synthetic",                                                 # source / scorer name
     "metadata": {...}}                                                   # optional; JSON-safe in files

``prompt`` is always a list of chat messages (a plain string becomes one user message), so the
tokenizer's chat template is the only place prompts are formatted. ``ground_truth`` and ``task``
reach the reward functions as TRL dataset columns of the same names.

Any other key is a dataset column of the user's file (``level``, verl's ``extra_info``, ...), kept
JSON-safe. As in TRL, every column reaches the reward functions as a keyword argument of that name,
one value per completion (None for a record without it), next to ``prompts`` (each completion's
prompt messages) and ``completion_ids`` (``reward_columns``). A column cannot take one of
``RESERVED_COLUMNS``: the reward call itself uses them.

(*) or None, only for a reasoning-gym task whose scorer checks an answer against the problem itself
(graph_color, rush_hour, ...; ``make_record(..., require_answer=False)``): the reward that can score
it is that scorer, which the run's task config then has to use (jetrl/run/tasks.py checks it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

Message = dict[str, str]
Record = dict[str, Any]

ROLES = ("system", "user", "assistant", "tool")


def to_messages(prompt: str | Sequence[Mapping[str, Any]]) -> list[Message]:
    """A prompt as chat messages: a string becomes one user message; messages are validated."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError("prompt is an empty string")
        return [{"role": "user", "content": prompt}]
    if not isinstance(prompt, Sequence) or len(prompt) == 0:
        raise ValueError(f"prompt must be a string or a non-empty list of chat messages, got {type(prompt).__name__}")
    messages = []
    for j, m in enumerate(prompt):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise ValueError(f"prompt message {j} must be a mapping with 'role' and 'content', got {m!r:.80}")
        if m["role"] not in ROLES:
            raise ValueError(f"prompt message {j} has role {m['role']!r}; expected one of {', '.join(ROLES)}")
        messages.append({"role": str(m["role"]), "content": _content_text(m["content"], j)})
    return messages


def _content_text(content: Any, j: int) -> str:
    """A message's content as text: a string, or TRL's / OpenAI's list of parts ``[{"type": "text", "text": ...}]``
    joined (a part of another type -- an image -- has no text form here: an error, never its repr)."""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and all(isinstance(p, Mapping) for p in content):
        texts = []
        for part in content:
            if part.get("type", "text") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"prompt message {j} has a content part of type {part.get('type')!r}; only text "
                                 "parts ({'type': 'text', 'text': ...}) are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise ValueError(f"prompt message {j} content must be a string or a list of text parts, got {content!r:.80}")


def json_safe(value: Any) -> Any:
    """``value`` with anything JSON cannot hold (Fraction, numpy scalars, ...) turned into str."""
    return json.loads(json.dumps(value, default=str))


RECORD_KEYS = ("prompt", "ground_truth", "task", "metadata")
# what a reward function is called with besides the columns (``reward_columns``; TRL's names)
RESERVED_COLUMNS = (*RECORD_KEYS, "completions", "prompts", "completion_ids")


def make_record(prompt: str | Sequence[Mapping[str, Any]], ground_truth: Any, task: str,
                metadata: Mapping[str, Any] | None = None, *, require_answer: bool = True,
                columns: Mapping[str, Any] | None = None) -> Record:
    """A validated record (see the module docstring); ``require_answer=False`` lets ``ground_truth`` be None;
    ``columns``: the dataset's other columns, passed to the reward functions by name."""
    if ground_truth is None and not require_answer:
        gold = None
    elif ground_truth is None or (isinstance(ground_truth, str) and not ground_truth.strip()):
        raise ValueError("record has no gold answer")
    elif isinstance(ground_truth, Mapping) or (isinstance(ground_truth, float) and not math.isfinite(ground_truth)):
        # its text ("{'v': 0}", "nan") could never be scored correct: a data error, not an answer
        raise ValueError(f"record's gold answer {ground_truth!r:.60} is a {type(ground_truth).__name__}; give it as "
                         "text or a finite number (a mapping belongs in 'metadata')")
    else:
        gold = str(ground_truth).strip()
    record: Record = {"prompt": to_messages(prompt), "ground_truth": gold, "task": str(task)}
    if metadata:
        record["metadata"] = json_safe(dict(metadata))
    for name, value in (columns or {}).items():
        if not isinstance(name, str) or name in RESERVED_COLUMNS:
            raise ValueError(f"column {name!r} cannot reach the reward functions under its name (the reward call "
                             "uses it); rename it in the dataset")
        record[name] = json_safe(value)
    return record


def column_names(records: Sequence[Record]) -> list[str]:
    """The dataset columns, beyond a record's own keys, that any of ``records`` holds: the columns every reward call
    on them passes (``reward_columns``), whichever records a batch holds. A name the reward call uses is an error."""
    names = sorted({key for record in records for key in record if key not in RECORD_KEYS})
    taken = [name for name in names if name in RESERVED_COLUMNS]
    if taken:
        raise ValueError(f"records hold a column {taken[0]!r}, a name the reward functions' call uses itself; rename "
                         "it")
    return names


def reward_columns(records: Sequence[Record], repeat: int = 1, names: Sequence[str] | None = None,
                   completion_ids: Sequence[Sequence[int]] | None = None) -> dict[str, list[Any]]:
    """The keyword arguments a reward function gets for ``records``, each record's values repeated ``repeat``
    times (its completions): ``prompts`` (the record's chat messages, without the run's system prompt),
    ``ground_truth``, ``task``, ``metadata``, ``completion_ids`` when given, and the dataset columns ``names``
    (default: ``column_names(records)``; give the whole dataset's, so that every batch passes the same ones), None
    where a record lacks one. TRL passes the same: all dataset columns."""
    names = column_names(records) if names is None else list(names)
    columns = {"prompts": [record.get("prompt") for record in records for _ in range(repeat)]}
    for name in ["ground_truth", "task", "metadata", *names]:
        columns[name] = [record.get(name) for record in records for _ in range(repeat)]
    if completion_ids is not None:
        if len(completion_ids) != len(records) * repeat:
            raise ValueError(f"{len(completion_ids)} completion_ids for {len(records)} records x {repeat}")
        columns["completion_ids"] = [list(ids) for ids in completion_ids]
    return columns
