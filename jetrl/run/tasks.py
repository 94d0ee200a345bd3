"""A run's data: (train, held-out) records from the task section of the config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jetrl.data import load_records, reasoning_gym_records, split_eval, synthetic_split
from jetrl.data.datasets import DatasetError, distinct_prompts

ANSWER_FREE_REWARDS = {"reasoning_gym", "format"}  # the registered rewards that never read a gold answer


def load_task(task: Any) -> tuple[list[dict], list[dict]]:
    """(train, held-out) records for a :class:`jetrl.run.config.TaskConfig`; held-out never in train."""
    if task.source == "tiny_adder":  # the split the built-in tiny start was SFT'd on (its held-out part is unseen)
        from jetrl.models.tiny import tiny_task_split

        train, held_out = tiny_task_split()
        if task.num_eval > len(held_out):
            raise ValueError(f"task.num_eval={task.num_eval}: the tiny_adder task holds out {len(held_out)} problems")
        return train[: task.num_train], held_out[: task.num_eval]
    if task.source == "synthetic":
        return synthetic_split(task.num_train, task.num_eval, task.seed, ops=list(task.name))
    # a task without gold answers can train only on rewards that do not read one (its own scorer, the format)
    answer_free = bool(task.reward_funcs) and set(task.reward_funcs) <= ANSWER_FREE_REWARDS
    if task.source == "reasoning_gym":
        records = reasoning_gym_records(task.name, task.num_train + task.num_eval, task.seed,
                                        allow_no_answer=answer_free, **task.options)
        if task.num_eval == 0:
            return records, []
        return _held_out(records, task, f"reasoning-gym task {task.name!r}", "raise task.num_train")
    records = load_records(task.path, require_answer=not answer_free)
    if not records:
        raise DatasetError(f"dataset file {task.path} holds no records")
    if task.eval_path:
        eval_records = load_records(task.eval_path, require_answer=not answer_free)
        return records, eval_records[: task.num_eval] if task.num_eval else eval_records
    if task.num_eval == 0:
        return records, []
    return _held_out(records, task, str(task.path), "give task.eval_path")


def pin_data_paths(task: Any) -> None:
    """Make ``task.path`` and ``task.eval_path`` (files or globs) absolute, for the run's config.yaml."""
    for name in ("path", "eval_path"):
        value = getattr(task, name)
        if value:
            setattr(task, name, str(Path(value).expanduser().absolute()))


def _held_out(records: list[dict], task: Any, where: str, other: str) -> tuple[list[dict], list[dict]]:
    """``split_eval`` of ``task.num_eval`` problems, or an error in the config's terms: records that share a prompt
    are one problem, held out together."""
    problems = distinct_prompts(records)
    if task.num_eval >= problems:
        raise DatasetError(f"{where} has {problems} distinct prompt(s) in {len(records)} records; task.num_eval="
                           f"{task.num_eval} leaves none to train on: lower task.num_eval or {other}")
    return split_eval(records, task.num_eval, task.seed)
