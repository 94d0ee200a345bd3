"""Offline task generators: reasoning-gym problems and a built-in synthetic arithmetic task.

Why offline generators: model hubs and dataset hubs are unreachable on the machines this runs
on, and procedurally generated problems have exact gold answers and unlimited supply.

* ``reasoning_gym_records`` wraps ``reasoning_gym.create_dataset(task, size=N, seed=S)``
  (gsm_symbolic: GSM8K-template word problems; basic_arithmetic, chain_sum: expressions). The
  question gets an instruction to box the answer (the convention of ``jetrl.rewards``); the
  entry's metadata is kept as reasoning-gym made it, so the ``reasoning_gym`` reward gives the
  task's scorer what it compares against (arc_agi's grids are tuples, which JSON would turn into
  lists and the scorer into a mismatch); ``save_records`` writes it JSON-safe. Some tasks have no
  gold answer at all (graph_color, rush_hour, rubiks_cube, ...: the scorer checks an answer against
  the problem): ``allow_no_answer=True`` keeps them, with ``ground_truth`` None.
  Two seeds can generate the same problem; take a held-out set with ``split_eval``.
* ``synthetic_split`` needs no dependency: "What is 23 + 58?" -> "81" over a finite problem
  space, for a tiny model trained from scratch. Problems are drawn without replacement with
  ``random.Random(seed)``, so the split is deterministic and train/eval never share a problem.
  For commutative ops a problem and its swap (23 + 58, 58 + 23) count as one problem and land
  in the same split, so the held-out score is not inflated by memorized swaps.
"""

from __future__ import annotations

import operator
import random
from collections.abc import Sequence
from typing import Any

from jetrl.data.records import Record, make_record

BOXED_INSTRUCTION = "Put your final answer within \\boxed{}."
SYNTHETIC_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_COMMUTATIVE = {"+", "*"}


def reasoning_gym_records(task: str, size: int, seed: int, *, instruction: str | None = BOXED_INSTRUCTION,
                          allow_no_answer: bool = False, **config: Any) -> list[Record]:
    """``size`` reasoning-gym problems of ``task`` as records; ``config`` goes to its dataset config. A task without
    gold answers is an error unless ``allow_no_answer`` (its records then hold ``ground_truth`` None)."""
    try:
        import reasoning_gym
    except ImportError as e:
        raise ImportError("reasoning-gym tasks need reasoning-gym: pip install reasoning-gym==0.1.25") from e
    try:
        dataset = reasoning_gym.create_dataset(task, size=size, seed=seed, **config)
    except ValueError as e:
        raise ValueError(f"reasoning-gym task {task!r}: {e}; the names are in reasoning_gym.factory.DATASETS") from e
    except (TypeError, AssertionError) as e:  # an unknown or inconsistent dataset option
        raise ValueError(f"reasoning-gym task {task!r} rejects the options {config}: {e or type(e).__name__}; "
                         f"see the task's config class in reasoning_gym") from e
    records = []
    for entry in dataset:
        if entry["answer"] is None and not allow_no_answer:
            raise ValueError(f"reasoning-gym task {task!r} has no gold answers (its scorer checks an answer against "
                             "each problem's metadata: boxnet, graph_color, propositional_logic, rubiks_cube, "
                             "rush_hour, ...): only its own scorer can reward it, so train it with "
                             "task.reward_funcs=['reasoning_gym'] (optionally with 'format'), or choose another task")
        question = entry["question"] if instruction is None else f"{entry['question']}\n{instruction}"
        record = make_record(question, entry["answer"], task, metadata=entry.get("metadata"),
                             require_answer=not allow_no_answer)
        if entry.get("metadata"):
            record["metadata"] = dict(entry["metadata"])  # the scorer's own objects (module docstring)
        records.append(record)
    return records


def _problem_space(ops: Sequence[str], min_operand: int, max_operand: int) -> list[tuple[str, int, int]]:
    values = range(min_operand, max_operand + 1)
    return [(op, a, b) for op in ops for a in values for b in values if op not in _COMMUTATIVE or a <= b]


def synthetic_record(op: str, a: int, b: int) -> Record:
    """One arithmetic problem: "What is a op b?" with gold answer str(a op b)."""
    return make_record(f"What is {a} {op} {b}?", str(SYNTHETIC_OPS[op](a, b)), "synthetic")


def synthetic_split(num_train: int, num_eval: int, seed: int, *, ops: Sequence[str] = ("+",),
                    min_operand: int = 0, max_operand: int = 99) -> tuple[list[Record], list[Record]]:
    """(train, held-out) synthetic arithmetic records, disjoint and deterministic given ``seed``."""
    unknown = [op for op in ops if op not in SYNTHETIC_OPS]
    if unknown or not ops:
        raise ValueError(f"synthetic ops must be a non-empty subset of {list(SYNTHETIC_OPS)}, got {list(ops)}")
    if len(set(ops)) != len(ops):  # a repeat would count its problems twice and let held-out ones into training
        raise ValueError(f"synthetic ops {list(ops)} repeat an operator; list each once (task.name='+*', not '++')")
    if min_operand > max_operand:
        raise ValueError(f"min_operand={min_operand} > max_operand={max_operand}")
    if num_train < 0 or num_eval < 0:
        raise ValueError(f"num_train and num_eval must be >= 0, got {num_train}, {num_eval}")
    space = _problem_space(ops, min_operand, max_operand)
    if num_train + num_eval > len(space):
        raise ValueError(f"asked for {num_train} + {num_eval} synthetic problems but ops={list(ops)} with operands "
                         f"{min_operand}..{max_operand} give only {len(space)} distinct ones: ask for fewer "
                         "(task.num_train + task.num_eval), add operators (task.name, e.g. '+*') or widen the "
                         "operand range (max_operand)")
    rng = random.Random(seed)
    picked = rng.sample(space, num_train + num_eval)
    records = []
    for op, a, b in picked:
        if op in _COMMUTATIVE and rng.random() < 0.5:
            a, b = b, a
        records.append(synthetic_record(op, a, b))
    return records[num_eval:], records[:num_eval]
