"""Python subprocesses side by side: interpreter scripts and whole runs.

The Triton interpreter runs a kernel's programs one after the other in one thread, and a tiny model's training run
is mostly Python, so a test that runs one such process at a time keeps one core busy and leaves the others idle
(CI has two). Independent processes -- an interpreter test split into scripts, the tiny preset under each recipe --
therefore run as many at once as this machine has cores (:func:`run_python`), each with one thread.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Side by side, one core each (the interpreter's dots are numpy matmuls, which would take every core each).
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def cores() -> int:
    """The cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def run_python(jobs: list[tuple[list[str], dict[str, str]]], timeout: float) -> list[subprocess.CompletedProcess]:
    """Run ``python *args`` with each job's environment, as many at once as there are cores; results in order."""
    def one(job):
        args, env = job
        try:
            return subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True,
                                  timeout=timeout, check=False)
        except subprocess.TimeoutExpired as e:  # killed: a failed result of its own, the other jobs run on
            out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
            return subprocess.CompletedProcess(e.cmd, -9, out, f"timed out after {timeout} s: {args[:4]}")

    with ThreadPoolExecutor(max_workers=min(cores(), max(1, len(jobs)))) as pool:
        return list(pool.map(one, jobs))


def run_jetrl(*argvs: list[str], timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """``python -m jetrl ARGV`` for each argv, side by side, one thread each; results in order."""
    return run_python([(["-m", "jetrl", *argv], {**os.environ, **ONE_THREAD}) for argv in argvs], timeout)


Script = str | tuple[str, dict[str, str | None]]  # a script, or (script, extra environment; None unsets)


def interpret(scripts: dict[str, Script], timeout: float = 600) -> dict[str, subprocess.CompletedProcess]:
    """Run each named script under TRITON_INTERPRET=1, side by side; their processes by name."""
    jobs = []
    for script in scripts.values():
        text, extra = script if isinstance(script, tuple) else (script, {})
        env = {**os.environ, "TRITON_INTERPRET": "1", **ONE_THREAD, **extra}
        jobs.append((["-c", text], {name: value for name, value in env.items() if value is not None}))
    return dict(zip(scripts, run_python(jobs, timeout)))


def check_ran(name: str, proc: subprocess.CompletedProcess, expect: str = "OK") -> str:
    """``proc``'s stdout if it exited 0 with ``expect`` in it; else AssertionError with its stdout and stderr."""
    assert proc.returncode == 0 and expect in proc.stdout, (
        f"interpreter script {name!r} failed (exit {proc.returncode}):\n{proc.stdout}{proc.stderr[-3000:]}")
    return proc.stdout


def run_interpreted(*scripts: Script, timeout: float = 600, expect: str = "OK") -> list[str]:
    """Run the scripts side by side (:func:`interpret`); each must exit 0 with ``expect`` in its stdout. Their
    stdouts, in order."""
    procs = interpret({f"{i + 1} of {len(scripts)}": script for i, script in enumerate(scripts)}, timeout)
    return [check_ran(name, proc, expect) for name, proc in procs.items()]
