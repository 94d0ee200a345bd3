"""Run configs: presets, YAML, dotted overrides, and one-line actionable errors."""

import os
import subprocess
import sys
from dataclasses import replace

import pytest

from jetrl.rl.config import GRPOConfig
from jetrl.run.config import RunConfig, resolve_config
from jetrl.run.presets import PRESETS, get_preset

from .subprocesses import run_jetrl


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
        ("", ["grpo.num_generations=1"], "num_generations=1 must be >= 2: an advantage is a reward minus"),
        ("", ["grpo.adam_beta1=2"], "grpo.adam_beta1=2.0 must be in \\[0, 1\\)"),
        ("", ["grpo.weight_decay=-1"], "grpo.weight_decay=-1.0 must be >= 0"),
        ("", ["grpo.beta=.inf"], "grpo.beta=inf must be >= 0 and finite"),
        ("", ["grpo.overlong_penalty_factor=-1"], "grpo.overlong_penalty_factor=-1.0 must be >= 0 and finite"),
        ("", ["grpo.learning_rate=.inf"], "grpo.learning_rate=inf must be > 0 and finite"),
        ("", ["grpo.temperature=.nan"], "grpo.temperature=nan must be >= 1e-05 and finite"),
        ("", ["grpo.temperature=1e-6"], "grpo.temperature=1e-06 must be >= 1e-05 .*decodes greedily"),
        ("", ["grpo.reward_weights=[a]"], "grpo.reward_weights=\\['a'\\] must be None \\(all 1\\) or a list of finite"),
        ("", ["grpo.reward_weights=[.nan]"], "must be None \\(all 1\\) or a list of finite numbers"),
        ("", ["grpo.reward_weights=[]"], "must be None \\(all 1\\) or a list of finite numbers"),
        ("", ["grpo.reward_weights=[1, 1]"], "has 2 entries for the 1 reward function\\(s\\) of task.reward_funcs"),
        ("", ["task.path=/data/train.jsonl"], "task.path is read only with task.source='file'.*add task.source=file"),
        ("", ["task.name=chain_sum"], "task.name='chain_sum' names a task of .*set task.source"),
        ("", ["grpo.chat_template_kwargs.tokenize=false"], "chat_template_kwargs=.*none of .*'tokenize'.*jetrl sets"),
        ("", ["grpo.chat_template_kwargs=[1]"], "grpo.chat_template_kwargs=\\[1\\] has the wrong type"),
        ("", ["eval.temperature=.nan"], "eval.temperature=nan >= 0 and finite"),
        ("", ["threads=0"], "threads=0 must be >= 1"),
        ("", ["task.reward_funcs=[1]"], "task.reward_funcs=\\[1\\] must be names"),
        ("", ["device=gpu"], "device='gpu' must be 'auto', 'cpu', 'cuda' or 'cuda:N'"),
        ("", ["grpo.importance_sampling_level=seq"], "importance_sampling_level='seq' must be one of \\('token', "),
        ("", ["grpo.lr_scheduler_type=step"], "lr_scheduler_type='step' must be one of \\('constant', "),
        ("", ["grpo.rollout_correction_level=seq"], "rollout_correction_level='seq' must be one of \\('token', "),
        ("", ["preset=default"], ("override 'preset=default' sets preset='default', but this config starts "
                                  "from preset 'tiny'.*pass --preset default")),
        ("preset: smollm2\n", [], "bad.yaml sets preset='smollm2'.*pass --preset smollm2"),
    ],
)
def test_invalid_config_is_one_actionable_error(tmp_path, yaml_text, overrides, match):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ValueError, match=match):
        resolve_config(get_preset("tiny"), path, overrides)


def test_preset_key_may_only_repeat_the_preset_started_from(tmp_path):
    # a saved run config (config.yaml) names its preset; reused with that --preset it resolves as before
    path = tmp_path / "run.yaml"
    path.write_text("preset: tiny\n")
    assert resolve_config(get_preset("tiny"), path, ["preset=tiny"]).to_dict() == get_preset("tiny").to_dict()


def test_unknown_preset_and_help():
    with pytest.raises(ValueError, match="unknown preset 'huge'; choose one of default, tiny, smollm2"):
        get_preset("huge")
    assert GRPOConfig.field_help()["num_generations"].startswith("completions per prompt")


CLI_ERRORS = [
    (["train", "--preset", "huge"], "unknown preset 'huge'"),
    (["train", "--recipe", "fp4"], "recipe='fp4'"),
    (["train", "--config", "/nonexistent.yaml"], "config file /nonexistent.yaml does not exist"),
    (["train", "--resume"], "--resume needs --run-dir"),
    (["train", "task.source=file", "task.path=/no/such.jsonl"], "dataset file not found: /no/such.jsonl"),
    (["generate", "--model", "/no/such/dir", "--prompt", "hi"], "neither 'tiny', 'smollm2' nor an existing"),
    (["eval", "--run", "/no/such/run", "task.num_eval=2"], "--run evaluates with the config that run was"),
    (["eval", "--preset", "tiny", "--num-samples", "0"], "--num-samples 0 must be >= 1"),
]


@pytest.fixture(scope="module")
def cli_errors() -> list[subprocess.CompletedProcess]:
    """Every command of CLI_ERRORS, side by side (tests/subprocesses.py)."""
    return run_jetrl(*(argv for argv, _ in CLI_ERRORS))


@pytest.mark.parametrize("case", range(len(CLI_ERRORS)), ids=[message for _, message in CLI_ERRORS])
def test_cli_errors_are_one_line(cli_errors, case):
    message, proc = CLI_ERRORS[case][1], cli_errors[case]
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_help_config_prints_every_key_with_its_resolved_value_and_runs_nothing(tmp_path, monkeypatch, capsys):
    """``jetrl train --help-config`` (promised by GRPOConfig's docstring): each leaf key once, dotted, with the value
    the preset, YAML and overrides resolve to (as a YAML scalar) and its help; no run directory is made."""
    import yaml

    from jetrl.cli import main
    from jetrl.run.config import describe

    monkeypatch.chdir(tmp_path)
    assert main(["train", "--preset", "tiny", "--help-config", "grpo.max_steps=3", "task.system_prompt=hi"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    keys = [key for key, _, _ in describe(get_preset("tiny"))]
    assert [line.split(" = ")[0] for line in lines] == keys and "grpo.learning_rate" in keys and "eval.every" in keys
    values = {line.split(" = ")[0]: line.split(" = ", 1)[1].rsplit("  # ", 1) for line in lines}
    assert yaml.safe_load(values["grpo.max_steps"][0]) == 3 and yaml.safe_load(values["task.system_prompt"][0]) == "hi"
    assert yaml.safe_load(values["run_dir"][0]) is None and yaml.safe_load(values["deterministic"][0]) is True
    assert values["grpo.num_generations"][1].startswith("completions per prompt")
    assert all(text.strip() for _, text in values.values())  # every field has its help
    assert not list(tmp_path.iterdir())  # nothing ran


def test_a_run_dir_is_never_overwritten_and_a_copied_run_resumes_where_it_is(tmp_path):
    """A new run refuses a directory that already holds one (it would delete that run's metrics and mix checkpoints);
    ``--resume`` continues the run in the directory given, also after the run was copied there; a damaged
    config.yaml is one line naming the file."""
    from jetrl.run.train import load_run_config

    old = tmp_path / "old"
    old.mkdir()
    cfg = get_preset("tiny")
    cfg.run_dir = str(tmp_path / "elsewhere")
    (old / "config.yaml").write_text(cfg.to_yaml())
    (old / "metrics.jsonl").write_text('{"step": 1}\n')
    assert load_run_config(old).run_dir == str(old)  # not the directory the run was started in
    proc = subprocess.run([sys.executable, "-m", "jetrl", "train", "--preset", "tiny", "--run-dir", str(old)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 2 and "already holds a run (metrics.jsonl)" in proc.stderr
    assert "--resume" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert (old / "metrics.jsonl").read_text() == '{"step": 1}\n'  # untouched
    (old / "config.yaml").write_text("grpo: [1, 2\n")
    with pytest.raises(ValueError, match="config.yaml is not valid YAML"):
        load_run_config(old)
    file_dir = tmp_path / "a_file"
    file_dir.write_text("x")
    proc = subprocess.run([sys.executable, "-m", "jetrl", "train", "--preset", "tiny", "--run-dir", str(file_dir)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 2 and "is a file" in proc.stderr and "Traceback" not in proc.stderr
    # a config an older jetrl saved with settings it ignored (now rejected) is read back as the run ran
    import yaml

    from jetrl.rl.checkpoint import resume_checkpoint
    from jetrl.run.train import _check_run_dir

    older = tmp_path / "older"
    older.mkdir()
    data = yaml.safe_load(cfg.to_yaml())
    data["task"].update(path="/data/x.jsonl", eval_path="/data/y.jsonl", name="chain_sum")
    data["grpo"]["reward_weights"] = []
    (older / "config.yaml").write_text(yaml.safe_dump(data))
    back = load_run_config(older)
    assert (back.task.path, back.task.eval_path, back.task.name, back.grpo.reward_weights) == (None, None, "+", None)
    # a run that stopped before logging a step left only its config (and an empty log): a new run may start there
    stopped = tmp_path / "stopped"
    (stopped / "tensorboard").mkdir(parents=True)
    (stopped / "config.yaml").write_text(cfg.to_yaml())
    (stopped / "metrics.jsonl").write_text("")
    _check_run_dir(stopped, resume=False)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint.*another --run-dir, or delete"):
        resume_checkpoint(stopped)
    (stopped / "checkpoints").mkdir()
    _check_run_dir(stopped, resume=False)  # an empty checkpoints dir holds nothing either
    with pytest.raises(OSError, match="run dir .*a_file/run cannot be written .*a_file is a file.*--run-dir"):
        _check_run_dir(file_dir / "run", resume=False)  # checked before the model loads
    _check_run_dir(tmp_path / "new" / "run", resume=False)
    assert not (tmp_path / "new").exists()  # the check makes no directory (another rank may be checking too)


def test_resume_points_at_complete_checkpoints_and_a_run_records_the_checkpoint_it_started_from(tmp_path):
    """`latest` naming a half-written step names the complete ones to point it at; a symlinked `latest` is followed;
    a run started from another run's directory records that run's checkpoint, not its moving `latest`."""
    from jetrl.models.export import resolve_checkpoint
    from jetrl.rl.checkpoint import STATE_FILE, latest_checkpoint
    from jetrl.run.models import pinned_model_name
    from jetrl.run.train import run_training

    run = tmp_path / "run"
    root = run / "checkpoints"
    for step in ("step_000001", "step_000002", "step_000003"):
        (root / step).mkdir(parents=True)
        (root / step / "config.json").write_text("{}")
    for step in ("step_000001", "step_000002"):
        (root / step / STATE_FILE).write_bytes(b"")
    (root / "latest").write_text("step_000003")  # its trainer state never written
    cfg = get_preset("tiny")
    cfg.run_dir = str(run)
    (run / "config.yaml").write_text(cfg.to_yaml())
    with pytest.raises(FileNotFoundError, match="does not point at a complete checkpoint, but step_000001, "
                                                "step_000002 are complete: .*echo step_000002 >"):
        run_training(cfg, resume=True)
    (root / "latest").unlink()
    (root / "latest").symlink_to(root / "step_000002")
    assert latest_checkpoint(run) == (root / "step_000002").resolve()
    assert pinned_model_name(str(run), resolve_checkpoint(run)) == str((root / "step_000002").resolve())
    assert pinned_model_name("tiny", tmp_path) == "tiny"


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


def test_prompts_files_name_the_bad_line(tmp_path):
    """`jetrl generate --prompts-file`: a bad prompt is named by file:line, a blank file and a file that is not UTF-8
    say so, and --raw takes a message list's last message (validated first)."""
    from jetrl.run.generate import encode_prompts, read_prompts

    cases = {"role.jsonl": ('{"prompt": "ok"}\n{"prompt": [{"role": "bot", "content": "x"}]}\n',
                            r"role\.jsonl:2: prompt message 0 has role 'bot'"),
             "number.jsonl": ('{"prompt": 5}\n', r"number\.jsonl:1: prompt must be a string or a non-empty list"),
             "blank.txt": ("\n  \n", r"prompts file .*blank\.txt holds no prompt"),
             "latin1.txt": (b"caf\xe9\n", r"prompts file .*latin1\.txt is not UTF-8 text")}
    for name, (content, match) in cases.items():
        path = tmp_path / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        with pytest.raises(ValueError, match=match):
            read_prompts(None, str(path))
    (tmp_path / "good.jsonl").write_text('{"prompt": [{"role": "user", "content": "2+3="}]}\n\n')
    prompts = read_prompts(["1+1="], str(tmp_path / "good.jsonl"))
    assert prompts == ["1+1=", [{"role": "user", "content": "2+3="}]]

    class Chars:
        def encode(self, text):
            return [ord(c) for c in text]

    assert encode_prompts(Chars(), prompts, raw=True) == [[49, 43, 49, 61], [50, 43, 51, 61]]
    # --chat-template-kwargs: a JSON object, checked as grpo.chat_template_kwargs is
    from jetrl.run.generate import template_kwargs_from_json

    assert template_kwargs_from_json(None) == {}
    assert template_kwargs_from_json('{"enable_thinking": false}') == {"enable_thinking": False}
    for bad, match in (("{enable", "is not valid JSON"), ("[1]", "must be a JSON object"),
                       ('{"add_generation_prompt": false}', "jetrl sets those")):
        with pytest.raises(ValueError, match=match):
            template_kwargs_from_json(bad)


def test_a_run_without_learning_signal_says_so_once():
    """Five RL steps in a row whose groups all agree (zero advantages) give one warning naming the likely cause; a
    step with signal resets the count."""
    from jetrl.run.train import NO_SIGNAL_STEPS, SignalWatch

    def last_warning(*steps, model="<model>", learning_rate=None, samples=None):
        watch = SignalWatch(4, model, learning_rate, samples)
        return [watch.update(i + 1, metrics) for i, metrics in enumerate(steps)][-1]

    flat = {"frac_reward_zero_std": 1.0, "reward": 0.0}
    watch, said = SignalWatch(8), []
    for step, metrics in enumerate([flat] * (NO_SIGNAL_STEPS - 1) + [{"frac_reward_zero_std": 0.5, "reward": 0.05}]
                                   + [flat] * 8, start=1):
        said.append(watch.update(step, metrics))
    assert [i for i, w in enumerate(said) if w] == [NO_SIGNAL_STEPS * 2 - 1]  # the second streak reaches 5, once
    assert "5 RL steps in a row had no learning signal" in said[-4] and "all 8 completions" in said[-4]
    assert "no sample was correct" in said[-4] and "task.reward_funcs" in said[-4]
    solved = last_warning(*[{"frac_reward_zero_std": 1.0, "reward": 1.0}] * NO_SIGNAL_STEPS)
    mixed = last_warning(*[{"frac_reward_zero_std": 1.0, "reward": 0.5}] * NO_SIGNAL_STEPS)
    assert "harder problems" in solved and "raise grpo.num_generations" in mixed
    # the cause comes from accuracy: a format reward of 1 with no correct answer is not "solved"
    formatted = last_warning(*[{"frac_reward_zero_std": 1.0, "reward": 1.0, "accuracy": 0.0}] * NO_SIGNAL_STEPS,
                             model="/models/m")
    assert "no sample was correct" in formatted and "jetrl generate --model /models/m" in formatted
    # all wrong after a step that was often right: training broke the policy (grpo.learning_rate=1 on the default)
    wrong = [{"frac_reward_zero_std": 1.0, "reward": 0.0, "accuracy": 0.0}] * NO_SIGNAL_STEPS
    collapsed = last_warning(*[{"frac_reward_zero_std": 0.5, "accuracy": a} for a in (0.16, 0.05, 0.02)], *wrong,
                             learning_rate=1.0, samples=64)  # 10 correct samples at step 1
    assert "the policy collapsed: accuracy was 0.160 at step 1, and no sample has been correct since step 3" in (
        collapsed)
    assert "grpo.learning_rate=1)" in collapsed
    lucky = last_warning({"frac_reward_zero_std": 0.5, "accuracy": 0.125}, *wrong, samples=8)  # one correct sample
    assert "no sample was correct" in lucky


def test_the_gsm8k_example_config_resolves():
    """examples/gsm8k.yaml (README: your model, your data) is a valid config with the overrides its header shows,
    and a GSM8K line of its data format scores a boxed completion against the gold answer after '####'."""
    from pathlib import Path

    from jetrl.data.records import make_record
    from jetrl.rewards.registry import compute_rewards

    example = Path(__file__).resolve().parents[1] / "examples" / "gsm8k.yaml"
    cfg = resolve_config(get_preset("default"), example, ["model.name=/models/Qwen3-1.7B",
                                                          "task.path=data/gsm8k/train.jsonl"])
    assert (cfg.recipe, cfg.model.dtype, cfg.task.source, cfg.grpo.loss_type) == ("jet", "bfloat16", "file", "dapo")
    assert cfg.task.system_prompt.endswith("in \\boxed{}.") and cfg.grpo.generation_batch_size == 256
    assert cfg.grpo.chat_template_kwargs == {"enable_thinking": False}
    assert cfg.grpo.generation_batch_size // cfg.grpo.num_generations == 32  # as its comment says
    record = make_record("Natalia sold 48 clips in April and half as many in May. How many in all?",
                         "48 / 2 = 24 clips in May.\n48 + 24 = 72 clips.\n#### 72", "gsm8k")
    rewards = compute_rewards(cfg.task.reward_funcs, ["She sold 24 in May, so \\boxed{72}.", "\\boxed{70}"],
                              ground_truth=[record["ground_truth"]] * 2)
    assert rewards == {"math": [1.0, 0.0]}


def test_chat_template_failures_are_one_line():
    """A chat template that raises (Jinja's errors, its raise_exception) or rejects a keyword is one ValueError naming
    the chat_template_kwargs it was given; --raw with template kwargs is refused."""
    from jetrl.data.chat import encode_prompts as encode_records
    from jetrl.run.generate import encode_prompts

    class Template:
        chat_template = "x"

        def apply_chat_template(self, messages, **kwargs):
            import jinja2

            raise jinja2.TemplateError("boom")

        def encode(self, text):
            return [1]

    with pytest.raises(ValueError, match=r"chat template failed with chat_template_kwargs=\{'a': 1\}: "
                                         "TemplateError: boom"):
        encode_records([{"prompt": "hi"}], Template(), template_kwargs={"a": 1})
    with pytest.raises(ValueError, match="TemplateError: boom"):
        encode_prompts(Template(), ["hi"], template_kwargs={"a": 1})
    with pytest.raises(ValueError, match="no effect with --raw"):
        encode_prompts(Template(), ["hi"], raw=True, template_kwargs={"a": 1})
