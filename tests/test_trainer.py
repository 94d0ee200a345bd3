"""GRPOTrainer and `jetrl train` on a random tiny model: updates, recipes, errors, exact resume."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import jetrl.rl.trainer as trainer_mod
from jetrl.data import PromptTooLongError, synthetic_split
from jetrl.fp8 import float8_modules, quantize
from jetrl.models import save_pretrained
from jetrl.models.llama import CausalLM
from jetrl.models.tiny import build_tiny_tokenizer, tiny_model_config
from jetrl.models.tokenizer import Tokenizer
from jetrl.rewards import RewardError
from jetrl.rl.config import GRPOConfig
from jetrl.rl.metrics import MISMATCH_KEYS
from jetrl.rl.replicas import Replicas
from jetrl.rl.trainer import GRPOTrainer, NonFiniteStepError

from .subprocesses import run_jetrl

ARGS = dict(learning_rate=1e-3, num_generations=4, generation_batch_size=16, per_device_train_batch_size=8,
            gradient_accumulation_steps=2, max_prompt_length=64, max_completion_length=6)


def length_reward(completions, **kwargs):
    """A reward with variance on a random model: longer completions score higher."""
    return [float(len(c)) for c in completions]


def _trainer(recipe="jet", seed=0, **overrides):
    torch.manual_seed(seed)
    model = CausalLM(tiny_model_config())
    train, _ = synthetic_split(64, 0, 0)
    args = GRPOConfig(**{**ARGS, "max_steps": 2, **overrides})
    return GRPOTrainer(model, [length_reward], args, train, tokenizer=Tokenizer(build_tiny_tokenizer()), recipe=recipe)


def test_one_step_changes_parameters_and_logs_every_metric():
    trainer = _trainer()
    before = [p.detach().clone() for p in trainer.model.parameters()]
    metrics = trainer.train_step()
    changed = sum(not torch.equal(b, p) for b, p in zip(before, trainer.model.parameters()))
    assert changed == len(before)
    for key in (*MISMATCH_KEYS, "reward", "reward_std", "accuracy", "completions/mean_length", "entropy",
                "grad_norm", "clip_ratio/region_mean", "time/rollout", "time/old_logprobs", "time/update"):
        assert key in metrics, key
    assert trainer.old_logprobs_source == "rollout" and metrics["grad_norm"] > 0


def test_fp8_weight_caches_follow_a_fused_optimizer(monkeypatch):
    """CUDA trains with AdamW(fused=True), which writes parameters without bumping their versions;
    the FP8 caches key on the version, so without the trainer's hook every FP8 forward after the first
    step would read the first step's codes (every GPU run from 791ca66 until the fix did). Forced on CPU here."""
    real = torch.optim.AdamW
    monkeypatch.setattr(torch.optim, "AdamW", lambda params, **kw: real(params, **{**kw, "fused": True}))
    trainer = _trainer("jet")
    assert trainer.optimizer.defaults["fused"] is True
    trainer.train_step()
    assert trainer.optimizer_steps >= 1
    spec = trainer.recipe.train.weight
    for name, module in float8_modules(trainer.model).items():
        fresh = quantize(module.weight.detach(), spec.block, pow2_scale=spec.pow2_scale)
        assert torch.equal(module.quantized_weight().codes.view(torch.uint8), fresh.codes.view(torch.uint8)), name


def test_reference_model_keeps_no_bf16_stack():
    trainer = _trainer("bf16", beta=0.05)
    assert trainer.model.model.layers[0].self_attn.qkv_stack is not None  # the policy's rollout stacks (on CUDA)
    assert all(layer.self_attn.qkv_stack is None and layer.mlp.gate_up_stack is None
               for layer in trainer.ref_model.model.layers)


def test_kl_reference_model_under_an_fp8_recipe():
    """beta > 0 copies the converted policy as the KL reference (jetrl/fp8/frozen.py). Under `jet` its FP8 layers
    keep their codes only: each BF16 master is a one-element placeholder, the reference scores exactly as the start
    policy does, and its codes are its own (the policy's in-place refresh after a step leaves them)."""
    trainer = _trainer("jet", beta=0.05)
    layers = float8_modules(trainer.ref_model)
    assert layers and all(m.weight.untyped_storage().nbytes() <= 4 for m in layers.values())
    policy = float8_modules(trainer.model)
    for name, layer in layers.items():  # copies of the codes, not the policy's buffers
        ours, theirs = layer.weight_cache._weight.codes, policy[name].weight_cache._weight.codes
        assert ours.untyped_storage().data_ptr() != theirs.untyped_storage().data_ptr(), name
    layer = next(iter(layers.values()))
    with pytest.raises(RuntimeError, match="frozen copy holds only the codes"):  # moved: no zeros quantized
        layer.weight_cache.get(torch.zeros(layer.weight.shape), trainer.recipe.train.weight)
    ids = torch.randint(3, 60, (2, 9))
    with torch.no_grad():
        start = trainer.ref_model(ids)
        assert torch.equal(start, trainer.model(ids))
    metrics = trainer.train_step()
    assert trainer.ref_model is not None and trainer.optimizer_steps == 1
    with torch.no_grad():
        assert torch.equal(trainer.ref_model(ids), start) and not torch.equal(trainer.model(ids), start)
    off_policy = float8_modules(_trainer("fp8_rollout", beta=0.05).ref_model).values()  # trains on its BF16 masters
    assert off_policy and all(m.weight.untyped_storage().nbytes() == m.weight.numel() * m.weight.element_size()
                              for m in off_policy)
    assert all(math.isfinite(v) for v in metrics.values() if isinstance(v, float))


@pytest.mark.parametrize("recipe, source", [("bf16", "recompute"), ("fp8_rollout", "recompute"), ("jet", "rollout"),
                                            ("jet_kv", "rollout"), ("fp8kv_rollout", "recompute")])
def test_old_logprobs_source_and_mismatch_per_recipe(recipe, source):
    trainer = _trainer(recipe)
    assert trainer.old_logprobs_source == source
    metrics = trainer.train_step()
    if recipe in ("fp8_rollout", "fp8kv_rollout"):
        # the rollout samples from another graph (fp8kv_rollout: FP8 K/V only; measured 1.0031)
        assert metrics["token_mult_prob_error"] > 1.001
    else:
        assert metrics["token_mult_prob_error"] < 1.001
    with pytest.raises(ValueError, match="needs an on-policy recipe"):
        _trainer("fp8_rollout", old_logprobs="rollout")


def test_trainer_logprobs_are_of_the_tempered_distribution_the_rollout_sampled():
    """At temperature T the engine samples from softmax(logits / T) and reports those logprobs; the trainer's old and
    new logprobs are of the same distribution (TRL divides by T too), so `jet` stays on-policy at T != 1 and `bf16`'s
    recomputed logprobs match the rollout's."""
    for recipe, source in (("jet", "rollout"), ("bf16", "recompute")):
        trainer = _trainer(recipe, temperature=0.7)
        assert trainer.old_logprobs_source == source
        metrics = trainer.train_step()
        assert metrics["token_mult_prob_error"] < 1.001, (recipe, metrics["token_mult_prob_error"])
        assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-3), recipe  # first pass: pi == pi_old


def test_rollout_logprobs_stand_in_for_pi_old_only_where_they_are_the_trainers():
    # a truncated rollout (top-p / top-k) reports the logprobs of the truncated distribution; a rollout correction
    # compares pi_old with the rollout: both need the trainer's pass, which 'auto' picks and 'rollout' refuses
    for overrides in ({"top_p": 0.9}, {"top_k": 5}, {"rollout_correction": "tis"}):
        assert _trainer("jet", **overrides).old_logprobs_source == "recompute", overrides
    with pytest.raises(ValueError, match="truncated distribution it sampled from"):
        _trainer("jet", top_p=0.9, old_logprobs="rollout")
    with pytest.raises(ValueError, match="makes the same tensor"):
        _trainer("jet", rollout_correction="mis", old_logprobs="rollout")


@pytest.mark.parametrize("recipe", ["jet", "bf16"])
def test_a_step_whose_completions_are_all_masked_trains_on_and_measures_the_mismatch(recipe, monkeypatch):
    """mask_truncated_completions when every completion hit max_completion_length (likely early in a DAPO run): no
    token counts in the loss, the step runs, and the trainer-vs-rollout mismatch is still measured over every
    sampled token (it raised before). The all-zero loss mask is forced here: a random model stops at EOS at times."""
    real = trainer_mod.rollout

    def all_truncated(*args, **kwargs):
        batch, *rest = real(*args, **kwargs)
        batch.completion_mask.zero_()
        return (batch, *rest)

    monkeypatch.setattr(trainer_mod, "rollout", all_truncated)
    metrics = _trainer(recipe, mask_truncated_completions=True).train_step()
    assert metrics["token_mult_prob_error"] < 1.001 and math.isfinite(metrics["rollout_corr/kl"])
    assert metrics["grad_norm"] == 0.0  # nothing in the loss


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "bnpo"])
def test_micro_batch_losses_add_up_to_the_groups_aggregate(loss_type):
    """A short last micro-batch (DAPO dynamic sampling keeps whole groups only) must not weigh its sequences more:
    the weighted micro-batch losses of one accumulation group add up to the loss_type's aggregate over the group
    (bnpo: the mean of the micro-batches' token means, as TRL accumulates it)."""
    from jetrl.rl.loss import policy_loss

    torch.manual_seed(0)
    lp, old = torch.randn(24, 5) * 0.1, torch.randn(24, 5) * 0.1
    adv, mask = torch.randn(24), (torch.rand(24, 5) > 0.3).float()
    kw = {"loss_type": loss_type, "max_completion_length": 5, "num_items_in_batch": float(mask.sum())}
    parts = [slice(0, 16), slice(16, 24)]
    total = sum(policy_loss(lp[r], old[r], adv[r], mask[r], **kw)[0]
                * trainer_mod._micro_batch_weight(loss_type, r.stop - r.start, len(parts), 24) for r in parts)
    if loss_type == "bnpo":
        want = sum(policy_loss(lp[r], old[r], adv[r], mask[r], **kw)[0] for r in parts) / 2
    else:
        want = policy_loss(lp, old, adv, mask, **kw)[0]
    assert total.item() == pytest.approx(want.item(), rel=1e-6)


def test_optimizer_steps_per_rl_step_counts_the_last_partial_group():
    args = GRPOConfig(**{**ARGS, "generation_batch_size": 64, "per_device_train_batch_size": 16,
                         "gradient_accumulation_steps": 3, "num_iterations": 2})
    assert args.optimizer_steps_per_rl_step == 4  # 4 micro-batches per epoch: steps of 3 and 1, two epochs
    assert args.rl_step_optimizer_steps(world_size=2) == 2  # 2 micro-batches per rank and epoch: one step each


def test_the_trainer_follows_the_learning_rate_schedule():
    """Under lr_scheduler_type='linear' each optimizer step runs at learning_rate_at(its position), decaying over the
    run's scheduled steps (2 RL steps x 2 optimizer steps here): 1, 3/4, 1/2, 1/4 of the rate, as logged. A resume
    on two ranks, whose RL step makes 1 optimizer step, continues at the same fraction of the run."""
    trainer = _trainer(recipe="bf16", lr_scheduler_type="linear", gradient_accumulation_steps=1)
    rates = []
    trainer.optimizer.register_step_pre_hook(lambda opt, *_: rates.append(opt.param_groups[0]["lr"]))
    logged = [trainer.train_step()["learning_rate"] for _ in range(2)]
    assert rates == pytest.approx([1e-3, 7.5e-4, 5e-4, 2.5e-4]) and logged == pytest.approx(rates[1::2])
    trainer.step, trainer.replicas = 1, Replicas(0, 2)  # as if resumed after one RL step on two ranks
    assert trainer._lr() == pytest.approx(5e-4) and trainer._lr(0.5) == pytest.approx(2.5e-4)


def test_gspo_with_a_sequence_level_correction_trains_off_policy():
    """fp8_rollout (BF16 training, FP8 rollout) under GSPO with a sequence-level MIS: the trainer passes the level
    through, whole completions are weighted alike, and the step trains."""
    trainer = _trainer(recipe="fp8_rollout", importance_sampling_level="sequence", loss_type="grpo",
                       rollout_correction="mis", rollout_correction_level="geometric", old_logprobs="recompute")
    metrics = trainer.train_step()
    assert trainer.optimizer_steps >= 1 and math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
    assert 0 <= metrics["rollout_corr/rollout_rs_masked_fraction"] <= 1
    assert metrics["rollout_corr/rollout_is_mean"] > 0


def test_nonfinite_step_is_skipped_or_stops(monkeypatch):
    real = trainer_mod.policy_loss

    def nan_loss(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        return loss * float("nan"), stats

    monkeypatch.setattr(trainer_mod, "policy_loss", nan_loss)
    trainer = _trainer()
    before = [p.detach().clone() for p in trainer.model.parameters()]
    metrics = trainer.train_step()
    assert metrics["nonfinite_steps"] == 1 and trainer.optimizer_steps == 0
    assert all(torch.equal(b, p) for b, p in zip(before, trainer.model.parameters())), "a NaN step was applied"
    stopping = _trainer(nonfinite_step="stop")
    with pytest.raises(NonFiniteStepError, match="non-finite loss"):
        stopping.train_step()


def test_reward_function_that_raises_names_itself():
    def broken(completions, **kwargs):
        raise KeyError("gold")

    torch.manual_seed(0)
    train, _ = synthetic_split(16, 0, 0)
    trainer = GRPOTrainer(CausalLM(tiny_model_config()), [broken], GRPOConfig(**{**ARGS, "max_steps": 1}), train,
                          tokenizer=Tokenizer(build_tiny_tokenizer()))
    with pytest.raises(RewardError, match="reward function 'broken' raised on sample 0: KeyError"):
        trainer.train_step()


def test_reward_functions_get_the_datasets_columns_as_trl_passes_them():
    """Every column of a record reaches a ``**kwargs`` reward function per completion, with ``prompts`` and
    ``completion_ids``; a function without ``**kwargs`` gets only the columns it names."""
    seen = {}

    def by_level(completions, **kwargs):
        seen.update(kwargs)
        return [float(level or 0) for level in kwargs["level"]]

    def plain(completions, ground_truth):
        return [0.0] * len(completions)

    torch.manual_seed(0)
    train, _ = synthetic_split(16, 0, 0)
    train = [{**r, "level": i % 3} if i % 2 else r for i, r in enumerate(train)]  # a column half the records hold
    args = GRPOConfig(**{**ARGS, "max_steps": 1})
    trainer = GRPOTrainer(CausalLM(tiny_model_config()), [by_level, plain], args, train,
                          tokenizer=Tokenizer(build_tiny_tokenizer()))
    metrics = trainer.train_step()
    n = len(seen["level"])
    assert n == args.generation_batch_size and len(set(seen["level"])) > 1
    assert {"prompts", "completion_ids", "ground_truth", "task", "metadata", "level"} <= set(seen)
    assert all(len(column) == n for column in seen.values())
    record_of = {str(r["prompt"]): r for r in train}  # each completion's columns are its own prompt's record's
    assert all(seen["level"][i] == record_of[str(seen["prompts"][i])].get("level") for i in range(n))
    assert all(seen["ground_truth"][i] == record_of[str(seen["prompts"][i])]["ground_truth"] for i in range(n))
    assert all(isinstance(t, int) for ids in seen["completion_ids"] for t in ids)
    assert metrics["rewards/by_level/mean"] == sum(level or 0 for level in seen["level"]) / n
    assert metrics["rewards/plain/mean"] == 0.0


def test_prompt_longer_than_context_fails_at_start():
    with pytest.raises(PromptTooLongError, match="longer than max_prompt_length=8"):
        _trainer(max_prompt_length=8)
    context = tiny_model_config().max_position_embeddings
    with pytest.raises(ValueError, match=rf"max_completion_length=\d+ exceed the model's context of {context}"):
        _trainer(max_prompt_length=context)


# ----------------------------------------------------------------------------- the CLI job
@pytest.fixture(scope="module")
def random_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("random_tiny")
    torch.manual_seed(0)
    save_pretrained(CausalLM(tiny_model_config()), tiny_model_config(), path, dtype=torch.float32)
    build_tiny_tokenizer().save_pretrained(str(path))
    return path


def _job(ckpt, run_dir, *extra):
    return [sys.executable, "-m", "jetrl", "train", "--preset", "tiny", "--run-dir", str(run_dir),
            f"model.name={ckpt}", "task.num_train=64", "task.num_eval=8", "grpo.max_steps=6", "save_steps=2",
            "grpo.generation_batch_size=16", "grpo.num_generations=4", "grpo.per_device_train_batch_size=8",
            "grpo.gradient_accumulation_steps=2", "grpo.max_completion_length=6", "progress=false",
            "tensorboard=false", "task.reward_funcs=['tests.test_trainer:length_reward']", *extra]


@pytest.mark.parametrize("phase, words", [("_update", "grpo.per_device_train_batch_size"),
                                          ("rollout", "grpo.generation_batch_size")])
def test_out_of_memory_names_the_settings_to_lower(monkeypatch, phase, words, random_checkpoint, tmp_path, capsys):
    from jetrl.cli import main
    from jetrl.rl import StepOutOfMemoryError

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.32 GiB.\nmore allocator detail")

    if phase == "rollout":
        monkeypatch.setattr(trainer_mod, "rollout", oom)
    else:
        monkeypatch.setattr(GRPOTrainer, phase, oom)
    trainer = _trainer()
    with pytest.raises(StepOutOfMemoryError, match=f"step 0: the {phase.strip('_')} phase ran out of device memory "
                                                   r"\(CUDA out of memory. Tried to allocate 2.32 GiB.\); .*" + words):
        trainer.train_step()
    with pytest.raises(torch.OutOfMemoryError):  # still torch's error type for code that catches it
        trainer.train_step()
    # the CLI: a one-line error and exit code 2, no traceback
    assert main(_job(random_checkpoint, tmp_path / "run")[3:]) == 2
    err = capsys.readouterr().err
    assert "ran out of device memory" in err and "Traceback" not in err and "--resume" in err


def test_cli_gives_the_allocator_expandable_segments_unless_configured(monkeypatch):
    from jetrl.rl import memory

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.delenv(memory.ALLOC_CONF, raising=False)
    assert memory.default_allocator_settings() == "expandable_segments:True"
    assert os.environ[memory.ALLOC_CONF] == "expandable_segments:True"
    monkeypatch.setenv(memory.ALLOC_CONF, "max_split_size_mb:512")  # the user's own setting wins
    assert memory.default_allocator_settings() is None and os.environ[memory.ALLOC_CONF] == "max_split_size_mb:512"
    monkeypatch.delenv(memory.ALLOC_CONF)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # too late for this process: left alone
    assert memory.default_allocator_settings() is None and memory.ALLOC_CONF not in os.environ


def _final_state(run_dir):
    from safetensors.torch import load_file

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]
    return rows, load_file(run_dir / "checkpoints" / "step_000006" / "model.safetensors")


@pytest.mark.slow
def test_kill_dash_9_then_resume_is_bitwise_identical(random_checkpoint, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    full, killed = tmp_path / "full", tmp_path / "killed"
    # the default deterministic=true is what makes a GPU run (and so its resume) bit-reproducible
    # (jetrl/run/determinism.py); the resumed run reads it back from its config.yaml. The whole run and the one to
    # kill run side by side, one core each.
    whole = subprocess.Popen(_job(random_checkpoint, full), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env)
    job = subprocess.Popen(_job(random_checkpoint, killed), stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.time() + 300
        while not (killed / "checkpoints" / "step_000004" / "trainer_state.pt").exists():
            assert job.poll() is None and time.time() < deadline, "the run ended before it could be killed"
            time.sleep(0.05)
        job.send_signal(signal.SIGKILL)
        job.wait()
        stdout, stderr = whole.communicate(timeout=600)
    finally:
        for proc in (whole, job):
            if proc.poll() is None:
                proc.kill()
    assert whole.returncode == 0, stderr[-2000:]
    result = json.loads(stdout.strip().splitlines()[-1])
    assert result["steps"] == 6 and result["run_dir"] == str(full)
    assert f"name: {random_checkpoint.resolve()}" in (full / "config.yaml").read_text()  # the start, pinned
    assert set(result["mismatch"]) == set(MISMATCH_KEYS)

    latest = killed / "checkpoints" / (killed / "checkpoints" / "latest").read_text()
    assert (latest / "trainer_state.pt").exists() and (latest / "model.safetensors").exists()  # never half-written
    resumed = subprocess.run([sys.executable, "-m", "jetrl", "train", "--run-dir", str(killed), "--resume"],
                             capture_output=True, text=True, env=env, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    rows_full, weights_full = _final_state(full)
    rows_resumed, weights_resumed = _final_state(killed)
    assert rows_resumed == rows_full
    assert weights_full.keys() == weights_resumed.keys()
    assert all(torch.equal(weights_full[k], weights_resumed[k]) for k in weights_full)


def test_generate_checks_the_context_before_the_weights_load(random_checkpoint, monkeypatch):
    from jetrl.run import generate

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were loaded before the context check")

    monkeypatch.setattr(generate, "load_model", no_weights)
    context = tiny_model_config().max_position_embeddings
    with pytest.raises(ValueError, match=rf"more than the model's context of {context}"):
        generate.generate_main(str(random_checkpoint), ["What is 1 + 2?"], max_tokens=context)


def test_train_checks_the_prompts_before_the_weights_load(random_checkpoint, tmp_path, monkeypatch):
    """`jetrl train` encodes its prompts (chat template, length limit) with the tokenizer alone: a prompt too long
    is one error before the weights load, not after."""
    from jetrl.run import train
    from jetrl.run.config import resolve_config
    from jetrl.run.presets import get_preset

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were loaded before the prompts were checked")

    monkeypatch.setattr(train, "load_model", no_weights)
    cfg = resolve_config(get_preset("tiny"), overrides=[f"model.name={random_checkpoint}", "task.source=synthetic",
                                                        "task.num_train=8", "task.num_eval=2",
                                                        "grpo.max_prompt_length=8", f"run_dir={tmp_path / 'run'}"])
    with pytest.raises(PromptTooLongError, match="longer than max_prompt_length=8"):
        train.run_training(cfg)


def test_a_run_records_its_data_paths_absolute(random_checkpoint, tmp_path, monkeypatch):
    """Relative task.path / task.eval_path (a glob too) are recorded absolute, as the model is, so a resume or `jetrl
    eval --run` from another directory reads the same files."""
    from jetrl.data import save_records
    from jetrl.run import train
    from jetrl.run.config import resolve_config
    from jetrl.run.presets import get_preset

    class Loaded(Exception):
        pass

    def stop(*args, **kwargs):
        raise Loaded

    records, held_out = synthetic_split(8, 2, 0)
    (tmp_path / "data").mkdir()
    save_records(records, tmp_path / "data" / "train-00000-of-00001.jsonl")
    save_records(held_out, tmp_path / "data" / "test.jsonl")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(train, "load_model", stop)
    cfg = resolve_config(get_preset("tiny"), overrides=[f"model.name={random_checkpoint}", "task.source=file",
                                                        "task.path=data/train-*", "task.eval_path=data/test.jsonl",
                                                        f"run_dir={tmp_path / 'run'}"])
    with pytest.raises(Loaded):
        train.run_training(cfg)
    assert (cfg.task.path, cfg.task.eval_path) == (str(tmp_path / "data" / "train-*"), str(tmp_path / "data" /
                                                                                          "test.jsonl"))


def test_generate_and_eval_commands(random_checkpoint, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is 1 + 2?"}) + "\n" + json.dumps({"prompt": "What is 3 + 4?"}) + "\n")
    commands = [  # three processes, side by side
        ["generate", "--model", str(random_checkpoint), "--prompts-file", str(prompts), "--prompt", "What is 5 + 6?",
         "--n", "2", "--temperature", "1.0", "--max-tokens", "5", "--logprobs"],
        ["generate", "--model", str(random_checkpoint), "--prompt", "What is 5 + 6?", "--recipe", "jet_kv",
         "--max-tokens", "5", "--logprobs"],  # the FP8 KV cache path of the CLI
        ["eval", "--preset", "tiny", "--model", str(random_checkpoint), "task.source=synthetic", "task.num_train=8",
         "task.num_eval=6", "grpo.max_completion_length=5", "--num-samples", "3", "--temperature", "1.0"]]
    generated, generated_kv, evaluated = run_jetrl(*commands)
    for proc in (generated, generated_kv, evaluated):
        assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(line) for line in generated.stdout.strip().splitlines()]
    assert len(lines) == 6 and {(x["prompt_index"], x["sample_index"]) for x in lines} == {(i, j) for i in range(3) for j in range(2)}
    assert all(len(x["logprobs"]) == len(x["token_ids"]) and all(lp <= 0 for lp in x["logprobs"]) for x in lines)
    (line,) = [json.loads(line) for line in generated_kv.stdout.strip().splitlines()]
    assert len(line["token_ids"]) == len(line["logprobs"]) >= 1
    result = json.loads(evaluated.stdout.strip().splitlines()[-1])
    assert result["num_problems"] == 6 and 0 <= result["pass@1"] <= result["pass@3"] <= 1


def test_a_damaged_checkpoint_is_one_error_naming_the_older_ones(tmp_path):
    """A truncated trainer_state.pt or model.safetensors (a disk fault, a copy cut short): an actionable ValueError
    naming the file and the older checkpoints to resume from, not a traceback from torch or safetensors."""
    from jetrl.models import load_pretrained
    from jetrl.models.loader import CheckpointError
    from jetrl.rl.checkpoint import STATE_FILE, load_trainer_state, save_checkpoint

    torch.manual_seed(0)
    model = CausalLM(tiny_model_config())
    optimizer = torch.optim.AdamW(model.parameters())
    for step in (1, 2):
        save_checkpoint(tmp_path, step, model, None, optimizer, {}, keep_last=2)
    last = tmp_path / "checkpoints" / "step_000002"
    (last / STATE_FILE).write_bytes((last / STATE_FILE).read_bytes()[:100])
    with pytest.raises(ValueError, match=r"step_000002 cannot be read .*writing its name \(step_000001\) into"):
        load_trainer_state(last, model, optimizer)
    weights = last / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:50])
    with pytest.raises(CheckpointError, match="model.safetensors cannot be read .* damaged or truncated"):
        load_pretrained(last)
