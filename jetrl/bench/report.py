"""Rows, targets, the printed table and the JSON of ``jetrl bench``.

A *row* is a plain dict. The table reads these keys (all optional but ``name``):

    name            what was measured
    unit            of ``baseline`` and ``value``: "ms", "us", "TB/s", "tok/s"
    baseline        the reference measured in the same run (BF16, the copy ceiling, the bytes
    baseline_label  floor, HF generate) and its label
    value           the measured quantity, and its label (e.g. "jet")
    value_label
    ratio           the figure of merit: speedup over BF16 (> 1 is faster), fraction of a
                    ceiling, or multiple of the bytes floor -- the row's ``note`` says which
    target, met     the issue's target for ``ratio`` (or ``value``) and whether it was met
    check           "ok" | "FAILED": the correctness check of the same run; FAILED fails the run
    check_detail    the numbers behind it (errors, SQNR)
    error           an exception that stopped this row; the run is then incomplete
    note            one short remark

Rows may hold any further keys; the JSON keeps them all. The exit code of ``jetrl bench`` is
1 if any check FAILED, else 3 if any row or section raised, else 0.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

from jetrl.bench.checks import FAILED

EXIT_OK, EXIT_CHECK_FAILED, EXIT_INCOMPLETE = 0, 1, 3
NAME_WIDTH = 44


def set_target(row: dict[str, Any], op: str, threshold: float, *, key: str = "ratio", unit: str = "x",
               smoke: bool = False) -> dict[str, Any]:
    """Attach the target ``row[key] op threshold`` (op is ">=" or "<=") and whether it was met.

    On a CPU smoke run the target is shown but not judged (``met`` is None): CPU timings say nothing.
    """
    row["target"] = f"{op}{threshold:g}{unit}"
    value = row.get(key)
    if smoke or value is None or (isinstance(value, float) and math.isnan(value)):
        row["met"] = None
    else:
        row["met"] = value >= threshold if op == ">=" else value <= threshold
    return row


def error_row(name: str, exc: BaseException) -> dict[str, Any]:
    return {"name": name, "error": f"{type(exc).__name__}: {exc}"}


def guarded(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``fn()``'s row, or an error row named ``name`` if it raises (the section's other rows survive)."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 -- recorded in the row; the exit code says the run is incomplete
        return error_row(name, exc)


def _fmt(value: float | None, unit: str | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if unit == "tok/s":
        return f"{value:,.0f} tok/s"
    if unit == "us":
        return f"{value:.1f} us"
    if unit == "TB/s":
        return f"{value:.2f} TB/s"
    return f"{value:.3f} {unit or ''}".rstrip()


def _labelled(label: str | None, value: float | None, unit: str | None) -> str:
    text = _fmt(value, unit)
    return f"{label} {text}" if label and text != "-" else text


def format_table(sections: dict[str, dict[str, Any]], *, smoke: bool) -> str:
    """The short table: one line per row, section wall times, targets next to the measured ratios."""
    lines = []
    if smoke:
        lines.append("SMOKE RUN: tiny shapes (on CPU: emulated FP8, no CUDA graphs); timings are MEANINGLESS, "
                     "only the checks count")
    header = (f"{'':2} {'measure':<{NAME_WIDTH}} {'baseline':>20} {'value':>20} {'ratio':>7} {'target':>9} {'met':>4}"
              "  check | note")
    lines += [header, "-" * len(header)]
    for key, section in sections.items():
        status = f"ERROR {section['error']}" if section.get("error") else ""
        lines.append(f"{key}  [{section['title']}] {section['wall_s']:.1f} s {status}".rstrip())
        for row in section["rows"]:
            ratio = row.get("ratio")
            met = row.get("met")
            check = row.get("check") or ""
            if row.get("check_detail"):
                check = f"{check} ({row['check_detail']})"
            if row.get("error"):
                check = f"ERROR {row['error']}"[:200]
            note = f" | {row['note']}" if row.get("note") else ""
            lines.append(
                f"{'':2} {row['name'][:NAME_WIDTH]:<{NAME_WIDTH}} "
                f"{_labelled(row.get('baseline_label'), row.get('baseline'), row.get('unit')):>20} "
                f"{_labelled(row.get('value_label'), row.get('value'), row.get('unit')):>20} "
                f"{'-' if ratio is None else f'{ratio:.2f}':>7} {row.get('target') or '':>9} "
                f"{'' if met is None else ('yes' if met else 'NO'):>4}  {check}{note}".rstrip()
            )
    return "\n".join(lines)


def summarize(sections: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Failed checks, errors and every targeted ratio, for the final JSON line and the exit code."""
    failed, errors, targets = [], [], []
    for key, section in sections.items():
        if section.get("error"):
            errors.append(f"{key}: {section['error']}")
        for row in section["rows"]:
            label = f"{key}: {row['name']}"
            if row.get("check") == FAILED:
                failed.append(label)
            if row.get("error"):
                errors.append(f"{label}: {row['error']}")
            if row.get("target"):
                targets.append({"section": key, "measure": row["name"], "ratio": _round(row.get("ratio")),
                                "value": _round(row.get("value")), "target": row["target"], "met": row.get("met")})
    code = EXIT_CHECK_FAILED if failed else EXIT_INCOMPLETE if errors else EXIT_OK
    return {"ok": code == EXIT_OK, "exit_code": code, "failed_checks": failed, "errors": errors, "targets": targets}


def _round(x: float | None) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else round(x, 4)


def to_json(obj: Any) -> str:
    """JSON with NaN/Inf written as null (strict JSON readers reject NaN)."""
    return json.dumps(_clean(obj), indent=1)


def _clean(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if obj is None or isinstance(obj, (str, int, bool)):
        return obj
    return str(obj)
