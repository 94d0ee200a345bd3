"""RunConfig: everything a run needs, as dataclasses; YAML files and dotted overrides on top.

Resolution order (later wins): the preset (a Python function in presets.py) -> a YAML file
(``--config run.yaml``, same nesting as the dataclasses) -> dotted CLI overrides
(``grpo.learning_rate=3e-5 task.num_train=500``; values are parsed as YAML scalars). An unknown
key, a wrong type or an invalid value fails before anything runs, with the field's path and
the fix. The resolved config is printed and saved as ``RUN_DIR/config.yaml``; ``--resume``
reads it back, so a resumed run is the same run.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from jetrl.fp8.recipe import RECIPE_NAMES
from jetrl.rl.config import GRPOConfig


def _f(default: Any, help: str) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass(kw_only=True)
class ModelConfig:
    name: str = _f("tiny", "'tiny' (built-in start, shipped), 'smollm2' (converted, cached), an HF checkpoint dir or "
                           "a run dir (its latest checkpoint; the run records the checkpoint dir it started from)")
    dtype: str = _f("float32", "master weight dtype: 'float32' or 'bfloat16'")

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"model.dtype={self.dtype!r} must be 'float32' or 'bfloat16'")


@dataclass(kw_only=True)
class TaskConfig:
    source: str = _f("synthetic", "'tiny_adder' (the tiny start's own split), 'synthetic' (arithmetic), "
                                  "'reasoning_gym' or 'file' (jsonl/parquet)")
    name: str = _f("+", "synthetic: operators like '+' or '+*'; reasoning_gym: the task name, e.g. 'chain_sum'")
    path: str | None = _f(None, "file: training data (jsonl or parquet; verl format or plain), or a glob of a "
                                "split's shards ('data/train-*.parquet')")
    eval_path: str | None = _f(None, "file: held-out data (a file or a glob); None splits num_eval records off the "
                                     "training data")
    num_train: int = _f(2000, "training problems (synthetic / reasoning_gym / tiny_adder; a file source trains on "
                              "all its records)")
    num_eval: int = _f(200, "held-out problems")
    seed: int = _f(0, "seed of problem generation and of the held-out split")
    system_prompt: str | None = _f(None, "system message prepended to every prompt")
    reward_funcs: list[str] = _f(["math"], "reward functions by name (jetrl.rewards.REWARD_FUNCS)")
    options: dict[str, Any] = _f({}, "reasoning_gym: the task's dataset config, e.g. {max_terms: 3, max_digits: 2}")

    def __post_init__(self) -> None:
        if self.source not in ("tiny_adder", "synthetic", "reasoning_gym", "file"):
            raise ValueError(f"task.source={self.source!r} must be 'tiny_adder', 'synthetic', 'reasoning_gym' or 'file'")
        if self.source == "file" and not self.path:
            raise ValueError("task.source='file' needs task.path=<jsonl or parquet file>")
        for name in ("path", "eval_path"):  # set for another source, they would be silently ignored
            if getattr(self, name) and self.source != "file":
                raise ValueError(f"task.{name} is read only with task.source='file' (now {self.source!r}): add "
                                 f"task.source=file to train on {getattr(self, name)}")
        if self.source == "tiny_adder" and self.name != "+":  # the default preset's source: a name without a source
            raise ValueError(f"task.name={self.name!r} names a task of task.source='synthetic' or 'reasoning_gym'; "
                             f"task.source={self.source!r} does not read it: set task.source (e.g. "
                             "task.source=reasoning_gym for a reasoning-gym task), or task.name=+ to keep tiny_adder")
        if self.num_train < 1 or self.num_eval < 0:
            raise ValueError(f"task.num_train={self.num_train} must be >= 1 and task.num_eval={self.num_eval} >= 0")
        if not self.reward_funcs:
            raise ValueError("task.reward_funcs is empty: name at least one reward function, e.g. ['math']")
        if not all(isinstance(name, str) for name in self.reward_funcs):
            raise ValueError(f"task.reward_funcs={self.reward_funcs!r} must be names, e.g. ['math'] or "
                             "['my_module:my_reward']")
        if self.options and self.source != "reasoning_gym":
            raise ValueError(f"task.options is for task.source='reasoning_gym' (the dataset's config); "
                             f"task.source={self.source!r} takes none")
        reserved = sorted({"size", "seed", "instruction"} & set(self.options))
        if reserved:
            raise ValueError(f"task.options.{reserved[0]} is set by jetrl: use task.num_train / task.num_eval "
                             "(size) and task.seed instead")


@dataclass(kw_only=True)
class EvalConfig:
    num_samples: int = _f(1, "samples per held-out problem (k of pass@k)")
    temperature: float = _f(0.0, "0 = greedy pass@1; > 0 samples (needed for pass@k with k > 1)")
    every: int = _f(0, "also evaluate every N RL steps (0 = only at the start and the end)")

    def __post_init__(self) -> None:
        if self.num_samples < 1 or self.every < 0 or not 0 <= self.temperature < math.inf:
            raise ValueError(f"eval.num_samples={self.num_samples} must be >= 1, eval.every={self.every} >= 0 and "
                             f"eval.temperature={self.temperature} >= 0 and finite")
        if self.num_samples > 1 and self.temperature == 0:
            raise ValueError("eval.num_samples > 1 needs eval.temperature > 0 (greedy samples are all the same)")


@dataclass(kw_only=True)
class RunConfig:
    preset: str = _f("default", "the preset this config started from")
    recipe: str = _f("jet", f"precision recipe, one of {RECIPE_NAMES}")
    run_dir: str | None = _f(None, "output dir (None: runs/<preset>-<recipe>-<time>)")
    save_steps: int = _f(0, "checkpoint every N RL steps (0: only at the end)")
    keep_last: int = _f(2, "checkpoints kept")
    tensorboard: bool = _f(True, "write TensorBoard events next to metrics.jsonl")
    wandb_project: str | None = _f(None, "log to this W&B project (needs wandb)")
    progress: bool = _f(True, "progress line with ETA on stderr")
    threads: int | None = _f(None, "torch CPU threads (None: torch's default)")
    device: str = _f("auto", "'auto' (cuda if available, else cpu), 'cpu' or 'cuda[:N]'")
    exact: bool = _f(False, "exact mode: batch-invariant kernels, rollout logprobs equal the trainer's bit for bit "
                            "(jetrl/exact.py; slower on a GPU)")
    deterministic: bool = _f(True, "bit-reproducible runs and resumes on a GPU too: torch's deterministic "
                                   "algorithms, a fixed cuBLAS workspace (jetrl/run/determinism.py; its cost was "
                                   "within the noise at 1.7B and 8B shapes); false lets torch pick faster kernels")
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        if self.recipe not in RECIPE_NAMES:
            raise ValueError(f"recipe={self.recipe!r}: choose one of {list(RECIPE_NAMES)}")
        if self.save_steps < 0 or self.keep_last < 1:
            raise ValueError("save_steps must be >= 0 and keep_last >= 1")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads={self.threads} must be >= 1, or null for torch's default")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device={self.device!r} must be 'auto', 'cpu', 'cuda' or 'cuda:N'")
        weights = self.grpo.reward_weights
        if weights is not None and len(weights) != len(self.task.reward_funcs):
            raise ValueError(f"grpo.reward_weights={weights} has {len(weights)} entries for the "
                             f"{len(self.task.reward_funcs)} reward function(s) of task.reward_funcs="
                             f"{self.task.reward_funcs}: give one weight each, or null for all 1")
        if self.wandb_project is not None:
            if not self.wandb_project.strip():
                raise ValueError("wandb_project is empty: name a W&B project, or leave it unset (null)")
            if importlib.util.find_spec("wandb") is None:  # checked here, before any model is loaded
                raise ValueError(f"wandb_project={self.wandb_project!r} needs the wandb package: pip install wandb, "
                                 "or unset wandb_project (metrics.jsonl and TensorBoard are always written)")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def describe(config: Any, prefix: str = "") -> list[tuple[str, Any, str]]:
    """``(dotted key, value, help)`` of every leaf field of a config dataclass, sections expanded, in field order:
    what ``jetrl train --help-config`` prints (each field's help is its ``metadata["help"]``, written once)."""
    rows = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            rows += describe(value, f"{prefix}{f.name}.")
        else:
            rows.append((prefix + f.name, value, f.metadata.get("help", "")))
    return rows


def from_dict(cls: type, data: dict[str, Any], path: str = "") -> Any:
    """Build dataclass ``cls`` from a nested dict, checking keys and types; errors name the dotted path."""
    if not isinstance(data, dict):
        raise ValueError(f"{path or 'config'} must be a mapping, got {type(data).__name__}")
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        where = f"{path}." if path else ""
        raise ValueError(f"unknown config key {where}{unknown[0]}; valid keys here: {', '.join(known)}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in data.items():
        full = f"{path}.{name}" if path else name
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = from_dict(hint, value, full)
        else:
            kwargs[name] = _check_type(value, hint, full)
    return cls(**kwargs)


def _check_type(value: Any, hint: Any, path: str) -> Any:
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union else (hint,)
    for option in options:
        if option is type(None) and value is None:
            return None
        origin = typing.get_origin(option) or option
        if origin is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if origin is float and isinstance(value, str):  # YAML 1.1 reads 3e-5 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if origin is list and isinstance(value, list):
            return value
        if origin is dict and isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return value
        if origin in (int, str, bool) and type(value) is origin:
            return value
    raise ValueError(f"config {path}={value!r} has the wrong type: expected {hint}")


FREE_FORM = ("task.options", "grpo.chat_template_kwargs")  # mappings whose keys belong to another library


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        if not isinstance(node.get(key), dict):
            raise ValueError(f"override {dotted}: {key!r} is not a config section")
        node = node[key]
    if keys[-1] not in node and ".".join(keys[:-1]) not in FREE_FORM:
        raise ValueError(f"unknown config key {dotted}; valid keys here: {', '.join(node)}")
    node[keys[-1]] = value


def _merge(base: dict[str, Any], update: dict[str, Any], path: str = "") -> None:
    for key, value in update.items():
        full = f"{path}.{key}" if path else key
        if key not in base and path not in FREE_FORM:
            raise ValueError(f"unknown config key {full}; valid keys here: {', '.join(base)}")
        if isinstance(base.get(key), dict) and isinstance(value, dict):
            _merge(base[key], value, full)
        else:
            base[key] = value


def resolve_config(base: RunConfig, yaml_path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """``base`` (a preset) + YAML file + ``key.path=value`` overrides -> a validated RunConfig."""
    tree = base.to_dict()
    if yaml_path is not None:
        path = Path(yaml_path)
        if not path.is_file():
            raise FileNotFoundError(f"config file {path} does not exist")
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise ValueError(f"config file {path} is not UTF-8 text (byte {e.start}: {e.reason}); save it as "
                             "UTF-8") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise ValueError(f"config file {path} is not valid YAML{where}: {getattr(e, 'problem', e)}") from None
        if loaded is not None:
            if not isinstance(loaded, dict):
                raise ValueError(f"config file {path} must hold a mapping of sections, got {type(loaded).__name__}")
            _merge(tree, loaded)
            _check_preset(tree, base, f"config file {path}")
    for item in overrides or []:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like section.key=value, e.g. grpo.learning_rate=1e-5")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw
        _set_dotted(tree, key.strip(), value)
        _check_preset(tree, base, f"override {item!r}")
    return from_dict(RunConfig, tree)


def _check_preset(tree: dict[str, Any], base: RunConfig, source: str) -> None:
    """``preset`` records the preset a config started from; setting it in a YAML file or an override would only
    relabel the config (the run would still start from ``base``), so another value is an error naming ``--preset``."""
    if tree.get("preset") != base.preset:
        name = tree.get("preset")
        raise ValueError(f"{source} sets preset={name!r}, but this config starts from preset {base.preset!r}: "
                         f"'preset' only records where a config started; to start from {name!r}, pass --preset {name}")
