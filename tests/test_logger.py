"""MetricsLogger: metrics.jsonl on resume, and the W&B contract (init / log / finish, one W&B run
across --resume), checked against a stand-in ``wandb`` module; and the config-time check that a
W&B project needs the package."""

from __future__ import annotations

import importlib.machinery
import json
import sys
import types

import pytest

from jetrl.rl.logger import MetricsLogger
from jetrl.run.config import RunConfig


class FakeWandb(types.ModuleType):
    """The slice of the wandb API the logger uses, recording every call."""

    def __init__(self) -> None:
        super().__init__("wandb")
        self.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
        self.calls: list[tuple] = []
        self.ids = iter(f"id{i}" for i in range(100))
        self.util = types.SimpleNamespace(generate_id=lambda: next(self.ids))

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))
        fake = self

        class Run:
            def log(self, metrics, step):
                fake.calls.append(("log", dict(metrics), step))

            def finish(self):
                fake.calls.append(("finish",))

        return Run()


@pytest.fixture
def fake_wandb(monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    return fake


def test_wandb_init_log_finish_and_resume_keeps_the_run(fake_wandb, tmp_path):
    log = MetricsLogger(tmp_path, total_steps=3, tensorboard=False, wandb_project="proj", run_name="r",
                        config={"recipe": "jet"}, progress=False)
    log.log(1, {"reward": 0.5, "accuracy": 0.25})
    log.log(2, {"reward": 0.75})
    log.close()
    (_, init), *rest = fake_wandb.calls
    assert init == {"project": "proj", "name": "r", "config": {"recipe": "jet"}, "id": "id0", "resume": "allow"}
    assert rest == [("log", {"reward": 0.5, "accuracy": 0.25}, 1), ("log", {"reward": 0.75}, 2), ("finish",)]
    assert (tmp_path / "wandb_run_id").read_text().strip() == "id0"

    # --resume from step 1: the same W&B run, and metrics.jsonl keeps only the steps up to the checkpoint
    fake_wandb.calls.clear()
    log = MetricsLogger(tmp_path, total_steps=3, resume_step=1, tensorboard=False, wandb_project="proj",
                        run_name="r", progress=False)
    log.log(2, {"reward": 1.0})
    log.close()
    assert fake_wandb.calls[0][1]["id"] == "id0"
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["reward"]) for r in rows] == [(1, 0.5), (2, 1.0)]

    # a fresh run in the same directory starts a new W&B run
    fake_wandb.calls.clear()
    MetricsLogger(tmp_path, total_steps=3, tensorboard=False, wandb_project="proj", progress=False).close()
    assert fake_wandb.calls[0][1]["id"] != "id0"


def test_wandb_project_needs_the_package_at_config_time(monkeypatch, fake_wandb, tmp_path):
    assert RunConfig(wandb_project="proj").wandb_project == "proj"  # importable: accepted
    with pytest.raises(ValueError, match="wandb_project is empty"):
        RunConfig(wandb_project=" ")
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed: `import wandb` raises ImportError
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "wandb" else object())
    with pytest.raises(ValueError, match="needs the wandb package: pip install wandb"):
        RunConfig(wandb_project="proj")
    with pytest.raises(RuntimeError, match="needs the wandb package"):  # the logger alone, without a config
        MetricsLogger(tmp_path, total_steps=1, tensorboard=False, wandb_project="proj", progress=False)


def test_resume_drops_a_last_line_cut_short_and_names_a_damaged_one(tmp_path):
    """A run killed while writing metrics.jsonl leaves a partial last line: resume drops it (the checkpoint decides
    where the run continues); a damaged line before the last is an error naming the file and line."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "reward": 0.5}\n{"step": 2, "reward": 0.6}\n{"step": 3, "rew')
    MetricsLogger(tmp_path, total_steps=5, resume_step=2, tensorboard=False, progress=False).close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2 is not a metrics line .*delete or repair that line"):
        MetricsLogger(tmp_path, total_steps=5, resume_step=2, tensorboard=False, progress=False)


def test_a_message_never_shares_the_progress_line(tmp_path, capsys):
    """The progress line (stderr) is printed without its newline until the last step; a message (a warning) ends it
    first, so the two never run together."""
    logger = MetricsLogger(tmp_path, total_steps=3, tensorboard=False)
    logger.log(1, {"reward": 0.5})
    logger.message("warning: something")
    logger.message("and more")
    logger.log(2, {"reward": 0.5})
    logger.log(3, {"reward": 0.5})
    logger.close()
    out, err = capsys.readouterr()
    assert out == "warning: something\nand more\n"
    assert err.count("\n") == 2 and err.endswith("\n") and "step 1/3" in err.split("\n")[0]
