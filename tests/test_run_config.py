"""Run configs: presets, YAML, dotted overrides, and one-line actionable errors."""

import os
import subprocess
import sys
from dataclasses import replace

import pytest

from jetrl.rl.config import GRPOConfig
from jetrl.run.config import RunConfig, resolve_config
from jetrl.run.presets import PRESETS, get_preset


def test_every_preset_builds_and_validates():
    for name in PRESETS:
        cfg = get_preset(name)
        assert cfg.preset == name and resolve_config(cfg).to_dict() == cfg.to_dict()


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("recipe: bf16\ngrpo:\n  learning_rate: 3e-5\n  max_steps: 7\ntask:\n  num_eval: 10\n")
    cfg = resolve_config(get_preset("tiny"), path, ["grpo.max_steps=9", "task.reward_funcs=[math, format]"])
    assert cfg.recipe == "bf16" and cfg.grpo.learning_rate == 3e-5 and cfg.grpo.max_steps == 9
    assert cfg.task.num_eval == 10 and cfg.task.reward_funcs == ["math", "format"]
    assert resolve_config(RunConfig(), None, []).to_yaml() == RunConfig().to_yaml()


def test_task_options_reach_the_reasoning_gym_dataset(tmp_path):
    """task.options is free-form (the dataset's own config keys), from YAML and from dotted overrides."""
    assert get_preset("smollm2").task.options == {"max_terms": 2, "max_digits": 1}
    path = tmp_path / "run.yaml"
    path.write_text("task:\n  options:\n    max_digits: 2\n    min_terms: 3\n")
    cfg = resolve_config(get_preset("smollm2"), path, ["task.options.max_terms=3"])
    assert cfg.task.options == {"max_terms": 3, "max_digits": 2, "min_terms": 3}
    pytest.importorskip("reasoning_gym")
    from jetrl.run.tasks import load_task

    train, held_out = load_task(replace(cfg.task, num_train=20, num_eval=5))
    assert all(r["metadata"]["num_terms"] == 3 and r["metadata"]["num_digits"] <= 2 for r in train + held_out)
    with pytest.raises(ValueError, match="rejects the options"):
        load_task(replace(cfg.task, options={"max_terms": 1, "min_terms": 2}))


@pytest.mark.parametrize(
    "yaml_text, overrides, match",
    [
        ("grpo: [1, 2\n", [], "not valid YAML at line"),
        ("grpo:\n  lr: 1\n", [], "unknown config key grpo.lr; valid keys here: max_steps"),
        ("", ["grpo.max_steps=0"], "grpo.max_steps=0 must be an int >= 1"),
        ("", ["grpo.max_steps=ten"], "grpo.max_steps='ten' has the wrong type"),
        ("", ["recipe=fp4"], "recipe='fp4': choose one of"),
        ("", ["grpo.generation_batch_size=30"], "multiple of grpo.num_generations"),
        ("", ["task.source=file"], "task.source='file' needs task.path"),
        ("", ["nokey"], "must look like section.key=value"),
        ("", ["task.options.max_terms=2"], "task.options is for task.source='reasoning_gym'"),
        ("", ["task.options=[1]"], "task.options=\\[1\\] has the wrong type"),
        ("", ["task.source=reasoning_gym", "task.options.seed=3"], "task.options.seed is set by jetrl"),
        ("- a\n- b\n", [], "must hold a mapping"),
    ],
)
def test_invalid_config_is_one_actionable_error(tmp_path, yaml_text, overrides, match):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ValueError, match=match):
        resolve_config(get_preset("tiny"), path, overrides)


def test_unknown_preset_and_help():
    with pytest.raises(ValueError, match="unknown preset 'huge'; choose one of default, tiny, smollm2"):
        get_preset("huge")
    assert GRPOConfig.field_help()["num_generations"].startswith("completions per prompt")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--preset", "huge"], "unknown preset 'huge'"),
        (["train", "--recipe", "fp4"], "recipe='fp4'"),
        (["train", "--config", "/nonexistent.yaml"], "config file /nonexistent.yaml does not exist"),
        (["train", "--resume"], "--resume needs --run-dir"),
        (["train", "task.source=file", "task.path=/no/such.jsonl"], "dataset file not found: /no/such.jsonl"),
        (["generate", "--model", "/no/such/dir", "--prompt", "hi"], "neither 'tiny', 'smollm2' nor an existing"),
    ],
)
def test_cli_errors_are_one_line(argv, message):
    proc = subprocess.run([sys.executable, "-m", "jetrl", *argv], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_empty_dataset_file_is_one_line(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    proc = subprocess.run([sys.executable, "-m", "jetrl", "train", "task.source=file", f"task.path={empty}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and str(empty) in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_deterministic_sets_torch_and_cublas_for_the_run_only(monkeypatch):
    """``deterministic=true`` (jetrl/run/determinism.py): inside the run torch's deterministic algorithms are on
    (warn-only, without the fill of new tensors) and cuBLAS has a fixed workspace; afterwards torch's settings are
    back."""
    import torch

    from jetrl.run.determinism import CUBLAS_ENV, CUBLAS_FIXED_WORKSPACE, deterministic_algorithms

    assert resolve_config(get_preset("tiny"), None, ["deterministic=true"]).deterministic is True
    monkeypatch.delenv(CUBLAS_ENV, raising=False)
    before = torch.are_deterministic_algorithms_enabled()
    with deterministic_algorithms(False):
        assert torch.are_deterministic_algorithms_enabled() == before
    with deterministic_algorithms():
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.utils.deterministic.fill_uninitialized_memory is False  # a kernel per allocation, for nothing
        assert torch.zeros(3).index_add_(0, torch.tensor([0, 0]), torch.ones(2)).tolist() == [2, 0, 0]
    assert torch.are_deterministic_algorithms_enabled() == before
    assert torch.utils.deterministic.fill_uninitialized_memory is True  # torch's default, back
    assert os.environ[CUBLAS_ENV] == CUBLAS_FIXED_WORKSPACE
