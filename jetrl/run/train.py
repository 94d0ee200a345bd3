"""``jetrl train``: a whole run from a RunConfig: load, evaluate, GRPO, checkpoint, evaluate, summarize.

The run directory holds ``config.yaml`` (the resolved config), ``metrics.jsonl`` (one line per RL
step), ``tensorboard/``, ``checkpoints/step_N/`` (atomic, see rl/checkpoint.py) and
``summary.json``. Stdout ends with a summary table and, as its very last line, one JSON object:

    {"recipe", "steps", "eval_accuracy_initial", "eval_accuracy_final", "mismatch": {§6 metrics
     averaged over the run's steps}, "wall_s", "run_dir", ...}

``resume=True`` continues the run in ``run_dir`` from its latest checkpoint, with the config it
was started with, and ends exactly where an uninterrupted run would.

Under torchrun (``torchrun --nproc_per_node N -m jetrl train ...``) the N ranks are data-parallel
replicas (jetrl/rl/replicas.py): each loads the same start, rolls out and trains on its block of
every step's prompts and evaluates its block of the held-out problems; rank 0 alone writes the
run directory and prints. Checkpoints and the end of the run check that the replicas' weights
are still equal.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import yaml

from jetrl.data import encode_prompts
from jetrl.engine.sampling import prompt_seed
from jetrl.exact import exact_requested, use_exact
from jetrl.models.export import unwritable
from jetrl.models.tokenizer import load_tokenizer
from jetrl.rewards import correctness_func, resolve_reward_funcs
from jetrl.rl.checkpoint import load_trainer_state, resume_checkpoint, save_checkpoint
from jetrl.rl.logger import MetricsLogger
from jetrl.rl.metrics import MISMATCH_KEYS
from jetrl.rl.replicas import Replicas, close_replicas, init_replicas
from jetrl.rl.shard_state import whole_state
from jetrl.rl.trainer import GRPOTrainer
from jetrl.run.config import RunConfig, from_dict
from jetrl.run.determinism import deterministic_algorithms
from jetrl.run.evaluate import evaluate
from jetrl.run.models import load_model, model_path, pinned_model_name
from jetrl.run.tasks import load_task, pin_data_paths


def load_run_config(run_dir: str | Path) -> RunConfig:
    """The config a run was started with (``RUN_DIR/config.yaml``), its ``run_dir`` the directory it was read from:
    a run copied or moved elsewhere continues where it now is, never in the directory it was started in."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} holds no config.yaml: is it a jetrl run directory?")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"{path} is not valid YAML ({str(err).splitlines()[0]}...); restore it from a copy of the "
                         "run, or start a new run") from err
    if not isinstance(data, dict):
        raise TypeError(f"{path} must hold the run's config as a mapping; restore it from a copy of the run")
    _drop_ignored_settings(data)
    cfg = from_dict(RunConfig, data)
    cfg.run_dir = str(run_dir)
    return cfg


def _drop_ignored_settings(data: dict[str, Any]) -> None:
    """Settings an older jetrl accepted and ignored, which a config now rejects (jetrl/run/config.py): a run that
    saved them trained without them, so its config is read back as it ran."""
    task, grpo = data.get("task"), data.get("grpo")
    if isinstance(task, dict):
        if task.get("source") != "file":
            task.pop("path", None)
            task.pop("eval_path", None)
        if task.get("source") == "tiny_adder":
            task["name"] = "+"
    if isinstance(grpo, dict) and grpo.get("reward_weights") == []:
        grpo["reward_weights"] = None


def run_training(cfg: RunConfig, *, resume: bool = False) -> dict[str, Any]:
    """Train ``cfg`` (in exact mode if ``cfg.exact``: jetrl/exact.py; with deterministic algorithms if
    ``cfg.deterministic``: jetrl/run/determinism.py) and return the run's summary; under torchrun, as one of
    its data-parallel replicas (module docstring)."""
    with use_exact() if cfg.exact else contextlib.nullcontext(), deterministic_algorithms(cfg.deterministic):
        replicas, device = init_replicas(cfg.device)  # after the cuBLAS workspace is fixed: NCCL starts CUDA
        result = _run_training(cfg, resume, replicas, device)
    close_replicas(replicas)  # after an error the process exits without it: the other ranks may be mid-collective
    return result


def _run_training(cfg: RunConfig, resume: bool, replicas: Replicas, device: str) -> dict[str, Any]:
    start = time.time()
    main = replicas.is_main
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.grpo.seed)
    run_dir = Path(replicas.broadcast_object(  # rank 0's clock names a new run for every rank
        str(cfg.run_dir or f"runs/{cfg.preset}-{cfg.recipe}-{time.strftime('%Y%m%d-%H%M%S')}")))
    _check_run_dir(run_dir, resume, writes=main)
    checkpoint = resume_checkpoint(run_dir) if resume else None

    # cheap checks first: data and reward names fail before a model is built or loaded
    train_records, eval_records = load_task(cfg.task)
    if not resume:  # recorded absolute, like the model: a resume or `jetrl eval --run` from another directory
        pin_data_paths(cfg.task)
    resolve_reward_funcs(cfg.task.reward_funcs)
    cfg.grpo.generation_batch_size_per_rank(replicas.world_size)  # the step splits over the ranks
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={cfg.device!r} but this torch sees no CUDA GPU; use device=auto or device=cpu")
    with replicas.main_first():  # rank 0 builds a built-in start's cache (the others wait), then all load it
        tokenizer = load_tokenizer(model_path(cfg.model.name))
    # the prompts through the chat template and the length limit: a template or data error before the model loads
    encode = partial(encode_prompts, tokenizer=tokenizer, system_prompt=cfg.task.system_prompt,
                     max_prompt_length=cfg.grpo.max_prompt_length, template_kwargs=cfg.grpo.chat_template_kwargs)
    train_ids, eval_ids = encode(train_records), encode(eval_records)
    model, tokenizer, source = load_model(cfg.model.name, cfg.model.dtype, recipe=cfg.recipe, device=device,
                                          tokenizer=tokenizer)
    replicas.check_in_sync(model, "after loading the model")
    if not resume:
        # a directory is recorded as the checkpoint it resolved to: another run's `latest` moves on, and a resume
        # (its KL reference with beta > 0) must start from the very weights this run started from
        cfg.model.name = pinned_model_name(cfg.model.name, source)
    correct_func = correctness_func(cfg.task.reward_funcs)
    trainer = GRPOTrainer(model, cfg.task.reward_funcs, cfg.grpo, train_records, tokenizer=tokenizer,
                          recipe=cfg.recipe, system_prompt=cfg.task.system_prompt, accuracy_func=correct_func,
                          replicas=replicas, prompt_ids=train_ids)
    cfg.run_dir = str(run_dir)
    say = print if main else _quiet
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        _atomic_text(run_dir / "config.yaml", cfg.to_yaml())
    say(f"jetrl train: preset={cfg.preset} recipe={cfg.recipe} model={source} device={device} run_dir={run_dir}"
        + (f" data-parallel ranks={replicas.world_size}" if replicas.distributed else "")
        + (" (FP8 weights sharded)" if trainer.sharded else ""))
    say(cfg.to_yaml().rstrip())
    for name in ("shard_weights", "shard_optimizer_state"):
        if getattr(cfg.grpo, name) and not replicas.distributed:
            say(f"note: grpo.{name}=true has no effect on one process: it splits state over torchrun's ranks")
    say(f"precision flow: {json.dumps(trainer.recipe.metadata())}; exact mode: {exact_requested()}; "
        f"deterministic algorithms: {torch.are_deterministic_algorithms_enabled()}; "
        f"old logprobs: {trainer.old_logprobs_source}; training CUDA graphs: "
        f"{'on' if trainer.train_graphs is not None else 'off'}")

    def held_out() -> float | None:
        """pass@1 over every held-out problem, each rank evaluating its block of them."""
        if not eval_records:
            return None
        block = replicas.shard_range(len(eval_records))
        records = [eval_records[i] for i in block]
        passed = evaluate(trainer.engine, [eval_ids[i] for i in block], records,
                          max_tokens=cfg.grpo.max_completion_length, num_samples=cfg.eval.num_samples,
                          temperature=cfg.eval.temperature, seed=cfg.grpo.seed, correct_func=correct_func,
                          seeds=[prompt_seed(cfg.grpo.seed, i) for i in block],  # as one process would
                          )["pass@1"] * len(records) if records else 0.0
        total, count = replicas.sum([passed, len(records)])
        return total / count

    if checkpoint is not None:
        state = load_trainer_state(checkpoint, model, trainer.optimizer)
        trainer.load_state(state)
        eval_initial = state["eval_accuracy_initial"]
        say(f"resumed from {checkpoint} at step {trainer.step}")
        saved_world = state.get("world_size", 1)
        if saved_world != replicas.world_size:
            say(f"note: this run was saved by {saved_world} data-parallel rank(s) and continues on "
                f"{replicas.world_size}: prompts keep their sampling seeds, but micro-batches and gradient "
                "accumulation are per rank, so its optimizer steps are not the uninterrupted run's")
    else:
        eval_initial = held_out()
    say(f"held-out accuracy before training: {_fmt(eval_initial)} ({len(eval_records)} problems)")

    logger = MetricsLogger(run_dir, total_steps=cfg.grpo.max_steps, resume_step=trainer.step,
                           tensorboard=cfg.tensorboard, wandb_project=cfg.wandb_project, run_name=run_dir.name,
                           config=cfg.to_dict(), progress=cfg.progress) if main else None

    watch = SignalWatch(cfg.grpo.num_generations, cfg.model.name, cfg.grpo.learning_rate,
                        cfg.grpo.generation_batch_size)
    if resume and (run_dir / "metrics.jsonl").is_file():  # the steps already run count toward the warnings
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):  # a line cut short by the stop
                row = json.loads(line)
                if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= trainer.step:
                    watch.update(row["step"], row)

    def on_step(step: int, metrics: dict[str, float]) -> None:
        if cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.grpo.max_steps:
            metrics["eval/accuracy"] = held_out()
        if logger is not None:
            logger.log(step, metrics)
        warning = watch.update(step, metrics)
        if warning and logger is not None:
            logger.message(warning)
        if (cfg.save_steps and step % cfg.save_steps == 0) or step == cfg.grpo.max_steps:
            replicas.check_in_sync(model, f"checkpoint of step {step}")
            replicas.gather_optimizer_state(trainer.optimizer)
            # sharded weights: rank 0 writes them whole, as one process would (jetrl/rl/shard_state.py)
            whole = whole_state(model, trainer.optimizer, main) if trainer.sharded else None
            if main:
                save_checkpoint(run_dir, step, model, tokenizer, trainer.optimizer,
                                {**trainer.state_dict(), "eval_accuracy_initial": eval_initial},
                                keep_last=cfg.keep_last, whole=whole)
            replicas.barrier()  # the checkpoint is complete before any rank moves on

    try:
        trainer.train(on_step)
    finally:
        if logger is not None:
            logger.close()
    eval_final = held_out()
    if not main:
        return replicas.broadcast_object(None)
    history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    result = {
        "recipe": cfg.recipe,
        "preset": cfg.preset,
        "steps": trainer.step,
        "eval_accuracy_initial": eval_initial,
        "eval_accuracy_final": eval_final,
        "mismatch": _run_mean(history, MISMATCH_KEYS),
        "reward_first": history[0].get("reward") if history else None,
        "reward_last": history[-1].get("reward") if history else None,
        "on_policy": trainer.policy_report["on_policy"],
        "old_logprobs": trainer.old_logprobs_source,
        "nonfinite_steps": trainer.nonfinite_steps,
        "wall_s": round(time.time() - start, 1),
        "run_dir": str(run_dir),
    }
    if replicas.distributed:
        result["data_parallel_ranks"] = replicas.world_size
    _atomic_text(run_dir / "summary.json", json.dumps(result, indent=1))
    _print_summary(result)
    print(json.dumps(result))
    return replicas.broadcast_object(result)


NO_SIGNAL_STEPS = 5  # RL steps in a row without a learning signal before the run says so
COLLAPSE_CORRECT = 5  # correct samples in one step from which a later run of all-wrong steps reads as a collapse


@dataclass
class SignalWatch:
    """Says when a run has stopped learning, and why. A GRPO group whose completions all got the same reward has
    zero advantages, so a step in which every group did (``frac_reward_zero_std`` = 1) trains nothing. A run that
    stays there is the commonest silent failure of RL: a reward function that never matches the data's answer
    format, problems far too easy or too hard, or a policy that training broke. After ``NO_SIGNAL_STEPS`` such
    steps in a row the run says which, once per streak. The cause is read from the samples' ``accuracy`` (the
    task's correctness), not from the reward, which a format reward or partial credit can lift without a single
    correct answer. All wrong after a step with ``COLLAPSE_CORRECT`` or more correct samples (of
    ``samples_per_step``) is a collapse -- five steps without one after a step with five is not bad luck -- and the
    usual cause a learning rate too high: ``jetrl train grpo.learning_rate=1`` takes the default run from 0.156 at
    step 1 to 0 at step 3 (CPU, 2026-12-02). All wrong from the start is a data or reward mismatch. A resumed run
    replays its logged steps into the watch first (``update``'s return ignored)."""

    group_size: int
    model: str = "<model>"
    learning_rate: float | None = None
    samples_per_step: int | None = None  # completions scored per step (all ranks): accuracy x this = correct ones
    streak: int = 0
    peak: float = 0.0  # the best step accuracy so far, and its step
    peak_step: int = 0
    last_correct_step: int = 0

    def update(self, step: int, metrics: dict[str, float]) -> str | None:
        """The warning after RL step ``step`` with these ``metrics``, or None."""
        reward = metrics.get("reward", float("nan"))
        accuracy = metrics.get("accuracy", reward)
        if accuracy > 0:
            self.last_correct_step = step
        if accuracy > self.peak:
            self.peak, self.peak_step = accuracy, step
        if metrics.get("frac_reward_zero_std", 0.0) < 1.0:
            self.streak = 0
            return None
        self.streak += 1
        if self.streak != NO_SIGNAL_STEPS:
            return None
        lr = f"grpo.learning_rate={self.learning_rate:g}" if self.learning_rate is not None else "grpo.learning_rate"
        correct = self.peak * (self.samples_per_step or self.group_size)
        hint = (f"the policy collapsed: accuracy was {self.peak:.3f} at step {self.peak_step}, and no sample has been "
                f"correct since step {self.last_correct_step}; the usual cause is a learning rate too high for the "
                f"model ({lr}): start again with a lower one (from the start model, or from a checkpoint saved before "
                "the fall)" if accuracy <= 0 and correct >= COLLAPSE_CORRECT - 1e-6 else
                f"no sample was correct: compare what the model writes (`jetrl generate --model {self.model}`, with "
                "the run's system prompt) with the data's answers and task.reward_funcs" if accuracy <= 0 else
                "every sample was correct: use harder problems" if accuracy >= 1 else
                "the rewards agree within every group: raise grpo.num_generations or grpo.temperature")
        return (f"warning: {self.streak} RL steps in a row had no learning signal: in every group all "
                f"{self.group_size} completions got the same reward (mean {reward:.3f}, accuracy {accuracy:.3f}), "
                f"so every advantage is 0 and the policy gradient is 0; {hint}")


def _quiet(*_: Any, **__: Any) -> None:
    """``print`` on a data-parallel rank other than 0: rank 0 speaks for the run."""


def _run_mean(history: list[dict], keys: tuple[str, ...]) -> dict[str, float]:
    out = {}
    for key in keys:
        values = [row[key] for row in history if isinstance(row.get(key), (int, float))]
        if values:
            out[key] = sum(values) / len(values)
    return out


def _print_summary(result: dict[str, Any]) -> None:
    rows = [("recipe", result["recipe"]), ("steps", result["steps"]),
            ("held-out accuracy", f"{_fmt(result['eval_accuracy_initial'])} -> {_fmt(result['eval_accuracy_final'])}"),
            ("reward (first -> last step)", f"{result['reward_first']:.3f} -> {result['reward_last']:.3f}"
             if result["reward_first"] is not None else "-"),
            ("on-policy / old logprobs", f"{result['on_policy']} / {result['old_logprobs']}")]
    rows += [(key, f"{value:.3e}") for key, value in result["mismatch"].items()]
    rows += [("wall time", f"{result['wall_s']:.0f} s"), ("run dir", result["run_dir"])]
    width = max(len(k) for k, _ in rows)
    print("-" * (width + 30))
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    print("-" * (width + 30))


def _fmt(accuracy: float | None) -> str:
    return "-" if accuracy is None else f"{accuracy:.3f}"  # None: no held-out problems (task.num_eval=0)


def _check_run_dir(run_dir: Path, resume: bool, writes: bool = True) -> None:
    """A new run never writes into a directory that already holds one: it would delete that run's metrics and mix
    its checkpoints with the new ones (and ``keep_last`` could then prune the new run's). ``--resume`` continues it.
    A directory whose run stopped before logging a step (a bad reward function, an interrupted first evaluation)
    holds only its config: nothing to lose and nothing to resume, so a new run may start there. The process that
    writes the run (``writes``: rank 0) checks here, before the model loads, that the directory -- or, before it
    exists, its nearest existing parent -- takes a file, so that a bad path fails at once. It makes no directory
    (another rank checking the same path at the same time must not see one come and go, and a config error found
    later leaves nothing behind)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise FileExistsError(f"run dir {run_dir} is a file; pass a directory path with --run-dir")
    held = [name for name in ("metrics.jsonl", "checkpoints") if _non_empty(run_dir / name)]
    if held and not resume:
        raise FileExistsError(f"{run_dir} already holds a run ({', '.join(held)}): continue it with `jetrl train "
                              f"--run-dir {run_dir} --resume`, or start the new run in another --run-dir")
    if not writes:
        return
    problem = unwritable(run_dir)
    if problem:
        raise OSError(f"run dir {run_dir} cannot be written ({problem}): pass a writable path with --run-dir (or "
                      "run_dir in the config)")


def _non_empty(path: Path) -> bool:
    """A file with content, or a directory with an entry."""
    if path.is_dir():
        return any(path.iterdir())
    return path.is_file() and path.stat().st_size > 0


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
