"""Where a run's metrics go: ``metrics.jsonl`` (always), TensorBoard, optional W&B, a progress line.

``metrics.jsonl`` is the record of truth: one JSON object per RL step, flushed at once. On
``--resume`` the lines after the checkpoint's step are dropped first, so the file reads as if
the run had never been interrupted. TensorBoard is written when ``tensorboard`` is importable
(``torch.utils.tensorboard``); W&B only when a project is configured (imported lazily).
The progress line shows step, ETA and a few headline metrics on stderr.

W&B: the run's id is kept in ``RUN_DIR/wandb_run_id``, so ``--resume`` continues the same W&B run
(``resume="allow"``) instead of starting a new one. W&B cannot delete points: steps after the
checkpoint that the interrupted run had logged stay in W&B, and W&B ignores re-logged steps that
are not beyond its last one (metrics.jsonl has the exact record).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

HEADLINE = ("reward", "accuracy", "completions/mean_length", "rollout_corr/k3_kl", "time/step")


class MetricsLogger:
    def __init__(self, run_dir: str | Path, *, total_steps: int, resume_step: int = 0, tensorboard: bool = True,
                 wandb_project: str | None = None, run_name: str | None = None, config: dict | None = None,
                 progress: bool = True) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step and self.path.exists():
            self.path.write_text("".join(f"{line}\n" for line in self._kept_lines(resume_step)))
        elif self.path.exists():
            self.path.unlink()
        self.total_steps, self.progress = total_steps, progress
        self._line_open = False  # a progress line was printed without its newline
        self.start, self.start_step = time.time(), resume_step
        self.tb = self.wandb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
            except ImportError:
                self.tb = None
        if wandb_project:
            self.wandb = _wandb_run(Path(run_dir), wandb_project, run_name, config, resuming=bool(resume_step))

    def _kept_lines(self, resume_step: int) -> list[str]:
        """The lines of steps up to the checkpoint's. A last line cut short (the run killed mid-write) is dropped:
        the checkpoint, not the log, decides where the run continues; a damaged line before it is an error."""
        lines = self.path.read_text().splitlines()
        kept = []
        for number, line in enumerate(lines, 1):
            if not line:
                continue
            try:
                step = json.loads(line)["step"]
            except (ValueError, KeyError, TypeError) as err:
                if number == len(lines):
                    break
                raise ValueError(f"{self.path}:{number} is not a metrics line ({type(err).__name__}: {err}); delete or "
                                 "repair that line, then resume again") from err
            if step <= resume_step:
                kept.append(line)
        return kept

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, **metrics}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                if self.tb is not None:
                    self.tb.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        if self.progress:
            self._progress(step, metrics)

    def _progress(self, step: int, metrics: dict[str, Any]) -> None:
        done = step - self.start_step
        elapsed = time.time() - self.start
        eta = elapsed / max(done, 1) * (self.total_steps - step)
        parts = [f"{k.split('/')[-1]} {metrics[k]:.4g}" for k in HEADLINE if isinstance(metrics.get(k), (int, float))]
        bar = "#" * int(20 * step / self.total_steps)
        print(f"\r[{bar:<20}] step {step}/{self.total_steps}  eta {eta:5.0f}s  " + "  ".join(parts),
              end="\n" if step == self.total_steps else "", file=sys.stderr, flush=True)
        self._line_open = step != self.total_steps

    def message(self, text: str) -> None:
        """Print ``text`` (stdout) on a line of its own: an open progress line (stderr) is ended first."""
        if self._line_open:
            print(file=sys.stderr, flush=True)
            self._line_open = False
        print(text, flush=True)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _wandb_run(run_dir: Path, project: str, name: str | None, config: dict | None, *, resuming: bool) -> Any:
    """A W&B run for ``run_dir``: the one recorded in ``run_dir/wandb_run_id`` when resuming, else a new one."""
    try:
        import wandb  # optional dependency
    except ImportError as exc:
        raise RuntimeError(f"wandb_project={project!r} needs the wandb package: pip install wandb, or unset "
                           "wandb_project") from exc
    id_file = run_dir / "wandb_run_id"
    run_id = id_file.read_text().strip() if resuming and id_file.exists() else wandb.util.generate_id()
    run = wandb.init(project=project, name=name, config=config, id=run_id, resume="allow")
    id_file.write_text(run_id + "\n")
    return run
