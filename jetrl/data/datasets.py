"""Load user datasets from jsonl or parquet into records, and split off a held-out eval set.

Why: no installable package holds GSM8K or MATH, so users bring their own files, usually in
one of two shapes, both normalized to the record schema (``records.py``):

* verl's: ``prompt`` (list of chat messages), ``reward_model.ground_truth``, ``data_source``;
* plain: ``prompt`` (a string or messages) or ``question``, plus ``ground_truth``, ``answer``
  or ``solution`` (a GSM8K ``"... #### 72"`` answer is fine: the math reward reads after ####).

The gold answer is looked up in that order; ``task`` is ``task``, else ``data_source``, else
the file's stem (a shard's without its ``-00000-of-00004``). A ``metadata`` dict (or its JSON
string, as ``save_records`` writes it to parquet) is kept, and so is every other column, for the
reward functions (records.py).
``.json`` files may hold a JSON array or JSON lines. Parquet is read with pyarrow (pandas as a
fallback), imported only when a parquet file is read. Every problem with the file is one
``DatasetError`` line naming the file and, for jsonl, the line number.

A path may also be a glob (``data/train-*.parquet``): the records of every match, files in name order,
which is how HF dataset repos shard a split. A directory is refused, with its dataset files named: a repo
directory usually holds every split side by side (``train-*``, ``test-*``), and reading them all would train
on the held-out problems.
"""

from __future__ import annotations

import glob
import json
import random
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jetrl.data.records import RECORD_KEYS, Record, json_safe, make_record

GOLD_KEYS = ("reward_model.ground_truth", "ground_truth", "answer", "solution")
PROMPT_KEYS = ("prompt", "question", "problem")  # "problem": MATH, NuminaMath, open-r1
JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
SHARD_SUFFIX = re.compile(r"-\d+-of-\d+$")  # HF's shard names: train-00000-of-00004


class DatasetError(ValueError):
    """A dataset file is missing, empty, unreadable or holds a record we cannot use."""


def _lookup(raw: Mapping[str, Any], dotted: str) -> Any:
    value: Any = raw
    for part in dotted.split("."):
        if not isinstance(value, Mapping):
            return None
        value = value.get(part)
    return value


def _first(raw: Mapping[str, Any], keys: Sequence[str]) -> Any:
    return _first_item(raw, keys)[1]


def _first_item(raw: Mapping[str, Any], keys: Sequence[str]) -> tuple[str | None, Any]:
    """(key, value) of the first of ``keys`` whose value is set (not None, not blank), else (None, None)."""
    for key in keys:
        value = _lookup(raw, key)
        if value is not None and not (isinstance(value, str) and not value.strip()):
            return key, value
    return None, None


def normalize_record(raw: Any, *, where: str, default_task: str, require_answer: bool = True) -> Record:
    """One raw row (verl or plain format) -> a record; ``where`` prefixes every error ("file:line");
    ``require_answer=False`` keeps a row without a gold answer (records.py: a task scored without one)."""
    if not isinstance(raw, Mapping):
        raise DatasetError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    prompt_key, prompt = _first_item(raw, PROMPT_KEYS)
    if prompt is None:
        raise DatasetError(f"{where}: record has no prompt; expected one of {', '.join(PROMPT_KEYS)}")
    gold = _first(raw, GOLD_KEYS)
    if gold is None and require_answer:
        raise DatasetError(f"{where}: record has no gold answer; expected one of {', '.join(GOLD_KEYS)} (only a "
                           "task whose rewards read none, task.reward_funcs=['reasoning_gym'] and/or 'format', "
                           "may leave it out)")
    metadata = raw.get("metadata")
    if isinstance(metadata, str):
        try:
            metadata = json.loads(metadata) if metadata else None
        except json.JSONDecodeError as e:
            raise DatasetError(f"{where}: metadata is a string but not JSON: {e.msg}") from None
    task = _first(raw, ("task", "data_source")) or default_task
    columns = {k: v for k, v in raw.items() if k != prompt_key and k not in RECORD_KEYS}
    try:
        return make_record(prompt, gold, task, metadata if isinstance(metadata, Mapping) else None,
                           require_answer=require_answer, columns=columns)
    except ValueError as e:
        raise DatasetError(f"{where}: {e}") from None


def _read_json(path: Path) -> list[tuple[str, Any]]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DatasetError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start}); write the dataset as UTF-8 "
                         "JSONL") from err
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}:{e.lineno}: malformed JSON: {e.msg} (column {e.colno})") from None
        return [(f"{path}: item {i}", row) for i, row in enumerate(rows)]
    rows = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append((f"{path}:{lineno}", json.loads(line)))
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}:{lineno}: malformed JSON line: {e.msg} (column {e.colno})") from None
    return rows


def _to_python(value: Any) -> Any:
    # pandas hands back numpy arrays for list columns and numpy scalars for numbers.
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, Mapping):
        return {k: _to_python(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_python(v) for v in value]
    return value


def _parquet_rows(path: Path) -> list[Any]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        pq = None
    if pq is not None:
        return pq.read_table(path).to_pylist()
    try:
        import pandas as pd
    except ImportError:
        raise DatasetError(f"{path}: reading parquet needs pyarrow: pip install pyarrow") from None
    return [_to_python(row) for row in pd.read_parquet(path).to_dict("records")]


def _read_parquet(path: Path) -> list[tuple[str, Any]]:
    try:
        rows = _parquet_rows(path)
    except DatasetError:
        raise
    except Exception as e:  # noqa: BLE001 -- pyarrow/pandas raise many types for a corrupt file
        raise DatasetError(f"{path}: cannot read parquet: {type(e).__name__}: {e}") from None
    return [(f"{path}: row {i}", row) for i, row in enumerate(rows)]


def dataset_files(path: str | Path) -> list[Path]:
    """The files ``path`` names: itself, or a glob's matches in name order (the module docstring; ``**`` spans
    directories); a missing file, a glob without a match or a directory is a DatasetError saying what to give."""
    text = str(path)
    literal = Path(text).expanduser()
    if any(c in text for c in "*?[") and not literal.is_file():  # gsm[1].jsonl may be a file's own name
        matches = sorted(Path(m) for m in glob.glob(str(literal), recursive=True) if Path(m).is_file())
        if not matches:
            raise DatasetError(f"no dataset file matches {text}")
        return matches
    if literal.is_dir():
        raise DatasetError(f"dataset path {literal} is a directory{_directory_hint(literal)}")
    if not literal.is_file():
        raise DatasetError(f"dataset file not found: {literal}")
    return [literal]


def _directory_hint(directory: Path) -> str:
    """What a directory holds and the glob to give instead: its dataset files, else those one level down (an HF
    dataset repo keeps its shards in data/)."""
    def files(folder: Path) -> list[Path]:
        return sorted(f for f in folder.iterdir() if f.suffix in (*JSON_SUFFIXES, ".parquet") and f.is_file())

    found = files(directory) or [f for sub in sorted(directory.iterdir()) if sub.is_dir() for f in files(sub)]
    if not found:
        return ": it holds no .jsonl, .json or .parquet file"
    names = [str(f.relative_to(directory)) for f in found]
    pick = next((f for f in found if f.name.startswith("train")), found[0])
    pattern = pick.parent / (SHARD_SUFFIX.sub("-*", pick.stem) + pick.suffix)
    return (f" (it holds {', '.join(names[:6])}{', ...' if len(names) > 6 else ''}): name one file, or a split's "
            f"shards with a glob, e.g. {pattern}")


def load_records(path: str | Path, *, default_task: str | None = None, require_answer: bool = True) -> list[Record]:
    """All records of a .jsonl/.json/.parquet file, or of a glob's files (:func:`dataset_files`), normalized (see
    the module docstring); ``require_answer=False`` keeps rows without a gold answer."""
    records = []
    for file in dataset_files(path):
        if file.suffix in JSON_SUFFIXES:
            rows = _read_json(file)
        elif file.suffix == ".parquet":
            rows = _read_parquet(file)
        else:
            raise DatasetError(f"{file}: unsupported dataset format {file.suffix!r}; use .jsonl, .json or .parquet")
        if not rows:
            raise DatasetError(f"{file}: dataset file is empty (no records)")
        task = default_task or SHARD_SUFFIX.sub("", file.stem)
        records += [normalize_record(row, where=where, default_task=task, require_answer=require_answer)
                    for where, row in rows]
    return records


def save_records(records: Sequence[Record], path: str | Path) -> None:
    """Write records as jsonl (one object per line) or parquet (``metadata`` as a JSON string)."""
    path = Path(path)
    if path.suffix in JSON_SUFFIXES:
        with path.open("w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(json_safe(r), ensure_ascii=False) + "\n")
    elif path.suffix == ".parquet":
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            raise DatasetError(f"{path}: writing parquet needs pyarrow: pip install pyarrow") from None
        # Per-row metadata dicts differ in keys and types; a JSON string keeps one column type.
        # Every row gets every column (metadata "null", others None when absent): pyarrow takes names from row 0.
        names = list(dict.fromkeys(key for r in records for key in r))
        rows = [{key: r.get(key) for key in names} for r in records]
        if "metadata" in names:
            rows = [{**r, "metadata": json.dumps(json_safe(r["metadata"]))} for r in rows]
        try:
            pq.write_table(pa.Table.from_pylist(rows), path)
        except (pa.ArrowException, TypeError, ValueError) as e:  # a column of mixed types, an empty struct
            raise DatasetError(f"{path}: parquet cannot hold these records' columns ({type(e).__name__}: {e}); "
                               "save them as .jsonl") from None
    else:
        raise DatasetError(f"{path}: unsupported dataset format {path.suffix!r}; use .jsonl, .json or .parquet")


def split_eval(records: Sequence[Record], eval_size: int | float,  # noqa: PYI041 -- a count or a fraction
               seed: int = 0) -> tuple[list[Record], list[Record]]:
    """(train, eval): ``eval_size`` distinct problems (a count >= 1, or a fraction in (0, 1) of the distinct
    problems) held out at random.

    A problem is its prompt: records with the same prompt (generators repeat easy problems -- reasoning-gym's
    two-term chain_sum gave 177 distinct prompts in 400 records, and 44 of 50 held-out ones were also in train)
    are held out together, and each once, so no held-out prompt is ever trained on. Deterministic given
    ``seed``; both parts keep the input order.
    """
    first: dict[str, int] = {}  # prompt -> index of its first record
    for i, record in enumerate(records):
        first.setdefault(_prompt_key(record), i)
    n = len(first)
    if isinstance(eval_size, bool) or not isinstance(eval_size, (int, float)):
        raise TypeError(f"eval_size must be a count (int) or a fraction (float), got {eval_size!r}")
    if isinstance(eval_size, float):
        if not 0.0 < eval_size < 1.0:
            raise ValueError(f"eval_size as a fraction must be in (0, 1), got {eval_size}")
        num_eval = max(1, round(eval_size * n))
    else:
        num_eval = eval_size
    if not 1 <= num_eval < n:
        raise ValueError(f"eval_size={eval_size} holds out {num_eval} of {n} distinct problems ({len(records)} "
                         "records); need at least 1 eval and 1 train problem")
    keys = list(first)
    held_out = {keys[j] for j in random.Random(seed).sample(range(n), num_eval)}
    train = [r for r in records if _prompt_key(r) not in held_out]
    return train, [records[i] for i in sorted(first[k] for k in held_out)]


def distinct_prompts(records: Sequence[Record]) -> int:
    """How many problems ``records`` hold: records with the same prompt are one (``split_eval``)."""
    return len({_prompt_key(record) for record in records})


def _prompt_key(record: Record) -> str:
    """A record's prompt as a canonical string (its chat messages, or its text)."""
    return json.dumps(record.get("prompt"), sort_keys=True, default=str)
