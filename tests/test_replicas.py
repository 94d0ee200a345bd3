"""Data-parallel replicas (jetrl/rl/replicas.py): two gloo ranks against one process.

The claims under test: two ranks that each train on part of a batch make the optimizer steps of one
process over the same micro-batches -- the same summed gradient for every loss type, with an empty rank
and with uneven ranks (on the CPU, and on one GPU where there is one); on the CPU a whole `torchrun -m
jetrl train` run of two ranks ends bit for bit where one process does, also resumed; rank 0 alone writes
the run. A 2-GPU machine also runs it over NCCL.
"""

import json
import os
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from jetrl.data import synthetic_split
from jetrl.models.llama import CausalLM
from jetrl.models.tiny import build_tiny_tokenizer, tiny_model_config
from jetrl.models.tokenizer import Tokenizer
from jetrl.rl.batch import RolloutBatch
from jetrl.rl.config import GRPOConfig
from jetrl.rl.replicas import Replicas, with_weight
from jetrl.rl.trainer import GRPOTrainer

LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "bnpo")
ROWS = 8  # the whole batch; each of two ranks trains on 4 rows


def _batch(rows: slice | torch.Tensor) -> RolloutBatch:
    """A fixed batch of ROWS completions of different lengths, two of them masked out of the loss."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 60, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
               for _ in range(ROWS)]
    completions = [torch.randint(3, 60, (1 + i % 5,), generator=g).tolist() for i in range(ROWS)]
    logprobs = [(-torch.rand(len(c), generator=g) * 3).tolist() for c in completions]
    advantages = torch.randn(ROWS, generator=g)
    mask = [i not in (2, 5) for i in range(ROWS)]
    return RolloutBatch.build(prompts, completions, logprobs, advantages, mask).select(rows)


def _update_grads(loss_type: str, replicas: Replicas, rows: slice | torch.Tensor | None, accum: int,
                  recipe: str = "bf16") -> list[list[torch.Tensor]]:
    """The gradient of each optimizer step `_update` makes over `rows` of the fixed batch (None: no batch)."""
    torch.manual_seed(0)
    # a tiny step: the second optimizer step of the uneven case must see (nearly) the same policy on every path --
    # AdamW's first step is sign-like and would turn rounding-level gradient differences into lr-sized ones
    args = GRPOConfig(learning_rate=1e-9, num_generations=2, generation_batch_size=8 * replicas.world_size,
                      per_device_train_batch_size=2, gradient_accumulation_steps=accum, max_prompt_length=32,
                      max_completion_length=8, loss_type=loss_type, max_grad_norm=0.0, old_logprobs="recompute")
    train, _ = synthetic_split(16, 0, 0)
    trainer = GRPOTrainer(CausalLM(tiny_model_config()).to(replicas.device), "math", args, train,
                          tokenizer=Tokenizer(build_tiny_tokenizer()), recipe=recipe, replicas=replicas)
    grads: list[list[torch.Tensor]] = []
    trainer.optimizer.register_step_pre_hook(
        lambda opt, *_: grads.append([p.grad.detach().clone().cpu() for p in trainer.model.parameters()]))
    batch = None if rows is None else _batch(rows)
    if batch is not None:  # pi_old: the model's own logprobs, so that the ratios start at 1 and few tokens clip
        trainer._old_logprobs(batch, {})
    trainer._update(batch, {})
    return grads


def _worker(rank: int, world: int, store: str, out: str, empty_rank: int, device: str, recipe: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    # gloo, also for CUDA tensors: the GPU variant runs both ranks on one GPU, which NCCL does not allow
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        replicas = Replicas(rank, world, device)
        result = {}
        for loss_type in LOSS_TYPES:
            result[loss_type] = _update_grads(loss_type, replicas, slice(4 * rank, 4 * rank + 4), 2, recipe)
            rows = None if rank == empty_rank else slice(4 * rank, 4 * rank + 4)
            result[f"{loss_type}/one_rank_empty"] = _update_grads(loss_type, replicas, rows, 2, recipe)
            # rank 0: 2 micro-batches, rank 1: 1, one per optimizer step -- rank 1 adds zeros to the second step
            rows = slice(0, 4) if rank == 0 else slice(4, 6)
            result[f"{loss_type}/uneven"] = _update_grads(loss_type, replicas, rows, 1, recipe)
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("device,recipe", [("cpu", "bf16"), pytest.param("cuda", "jet", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_two_ranks_make_the_one_process_step_for_every_loss_type(tmp_path, device, recipe):
    torch.multiprocessing.spawn(_worker, args=(2, str(tmp_path / "store"), str(tmp_path), 1, device, recipe),
                                nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    one = Replicas(device=device)
    for loss_type in LOSS_TYPES:
        # one process, the whole batch: 4 micro-batches of 2 rows in one optimizer step
        whole = _update_grads(loss_type, one, slice(0, ROWS), 4, recipe)
        # one process, rank 0's half only: what the step is when rank 1 has no batch
        half = _update_grads(loss_type, one, slice(0, 4), 2, recipe)
        # one process, the uneven ranks' micro-batches in their optimizer steps: {0:2, 4:6}, then {2:4}
        uneven = _update_grads(loss_type, one, torch.tensor([0, 1, 4, 5, 2, 3]), 2, recipe)
        assert len(whole) == len(half) == 1 and len(uneven) == 2
        for key, expected in ((loss_type, whole), (f"{loss_type}/one_rank_empty", half),
                              (f"{loss_type}/uneven", uneven)):
            assert len(ranks[0][key]) == len(ranks[1][key]) == len(expected), f"{key}: optimizer steps"
            for step, (got0, got1, ref_step) in enumerate(zip(ranks[0][key], ranks[1][key], expected)):
                for i, (a, b, ref) in enumerate(zip(got0, got1, ref_step)):
                    assert torch.equal(a, b), f"{key}: the replicas' summed gradients differ"
                    assert ref.abs().max() > 0, f"{key}: parameter {i} has a zero gradient (an empty check)"
                    err = float((a - ref).abs().max() / ref.abs().max())  # normwise: sums in another order
                    assert err < 1e-5, f"{key}, step {step}, parameter {i}: max error {err:.2e} of its max"


def test_shard_range():
    assert [Replicas(r, 3).shard_range(10) for r in range(3)] == [range(4), range(4, 7), range(7, 10)]
    assert Replicas().shard_range(10) == range(10)
    with pytest.raises(ValueError, match="rank 2"):
        Replicas(2, 2)


@pytest.mark.parametrize("overrides,match", [
    ({"generation_batch_size": 24, "num_generations": 8}, "cannot split the step's 3 prompts"),
    ({"generation_batch_size": 16, "num_generations": 4, "per_device_train_batch_size": 16}, "samples 8 completions"),
])
def test_a_batch_the_ranks_cannot_split_is_an_actionable_error(overrides, match):
    args = GRPOConfig(max_prompt_length=32, max_completion_length=8, **{"per_device_train_batch_size": 8,
                                                                        **overrides})
    train, _ = synthetic_split(16, 0, 0)
    with pytest.raises(ValueError, match=match):
        GRPOTrainer(CausalLM(tiny_model_config()), "math", args, train, tokenizer=Tokenizer(build_tiny_tokenizer()),
                    recipe="bf16", replicas=Replicas(0, 2))


def test_merge_metrics_on_one_process_only_drops_the_weights():
    metrics = with_weight({"entropy": 0.5}, 12.0) | {"reward": 0.25, "time/step": 1.0}
    assert Replicas().merge_metrics(metrics) == {"entropy": 0.5, "reward": 0.25, "time/step": 1.0}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _jetrl_train(ranks: int, *args: str) -> subprocess.CompletedProcess:
    """`jetrl train ARGS` in one process, or under torchrun with `ranks` processes; it must succeed."""
    path = [str(Path(__file__).resolve().parents[1]), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(path)}
    launch = ["-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port", str(_free_port())]
    proc = subprocess.run([sys.executable, *(launch if ranks > 1 else []), "-m", "jetrl", "train", *args],
                          capture_output=True, text=True, env=env, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _train(run_dir: Path, device: str, ranks: int, *overrides: str) -> subprocess.CompletedProcess:
    """Two RL steps of the tiny preset, 16 completions each, a checkpoint after each. Micro-batches in rollout order:
    grouped by length, one process would regroup the rows two ranks hold apart (jetrl/rl/micro_batches.py)."""
    return _jetrl_train(ranks, "--preset", "tiny", "--run-dir", str(run_dir), "grpo.max_steps=2",
                        "grpo.group_by_length=false",
                        "grpo.generation_batch_size=16", "task.num_eval=6", "save_steps=1", "keep_last=1",
                        "progress=false", "tensorboard=false", f"device={device}", *overrides)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
def test_torchrun_on_two_gpus(tmp_path):
    run_dir = tmp_path / "run"
    _check_run_of_two_ranks(run_dir, _train(run_dir, "cuda", 2, "grpo.per_device_train_batch_size=8"))


def _check_run_of_two_ranks(run_dir: Path, proc: subprocess.CompletedProcess, pruned: bool = True) -> None:
    """Rank 0 alone wrote the run: one summary line, one metrics line per step, its checkpoints pruned (keep_last=1
    where ``pruned``)."""
    summaries = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"recipe"')]
    assert len(summaries) == 1, "rank 0 alone prints the summary line"
    summary = summaries[0]
    assert summary["data_parallel_ranks"] == 2 and summary["steps"] == 2
    assert summary["eval_accuracy_final"] is not None
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    row = json.loads(lines[-1])
    assert row["optimizer_steps"] >= 2 and row["grad_norm"] > 0
    assert (run_dir / "checkpoints" / "step_000002" / "trainer_state.pt").is_file()
    if pruned:
        assert not (run_dir / "checkpoints" / "step_000001").exists()  # keep_last=1: rank 0 alone saves and prunes


@pytest.mark.parametrize("options", [
    (),
    ("grpo.loss_type=grpo", "grpo.num_iterations=2", "grpo.beta=0.05", "grpo.scale_rewards=batch",
     "grpo.rollout_correction=tis", "grpo.old_logprobs=recompute",
     "grpo.shard_optimizer_state=true"),  # ZeRO-1: each rank updates its share of the parameters
], ids=["dapo", "grpo-2-iterations-kl-batch-std-tis-sharded-optimizer"])
def test_two_ranks_train_bit_for_bit_as_one_process(tmp_path, options):
    """On the CPU the engine and the trainer are batch-invariant, and each prompt samples with the seed of its place
    in the whole step: two ranks with micro-batches of 8 end with the very weights of one process that accumulates
    the same two micro-batches (a sum of two gradients is exact in either order)."""
    two, one = tmp_path / "two", tmp_path / "one"
    with ThreadPoolExecutor(2) as pool:  # the two runs side by side
        one_run = pool.submit(_train, one, "cpu", 1, "grpo.per_device_train_batch_size=8",
                              "grpo.gradient_accumulation_steps=2", *options)
        _check_run_of_two_ranks(two, _train(two, "cpu", 2, "grpo.per_device_train_batch_size=8", *options))
        one_run.result()
    weights = "checkpoints/step_000002/model.safetensors"
    assert (two / weights).read_bytes() == (one / weights).read_bytes()
    rows = [[json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] for run in (two, one)]
    for a, b in zip(*rows, strict=True):  # every metric: token-level means are merged with their weights
        assert a.keys() == b.keys() and "entropy" in a and "clip_ratio/region_mean" in a
        for key in a:
            if not key.startswith("time/"):
                assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-12), (a["step"], key)
    finals = [json.loads((run / "summary.json").read_text())["eval_accuracy_final"] for run in (two, one)]
    assert finals[0] == pytest.approx(finals[1], abs=1e-12)


def test_two_ranks_resume_bit_for_bit(tmp_path):
    """`--resume` under torchrun continues where the uninterrupted two-rank run would have been, bit for bit, also
    with a sharded optimizer state: rank 0's checkpoint holds every rank's share, and each rank takes its own back
    (a whole one loads as on one process: tests/test_trainer.py's resume)."""
    run = tmp_path / "run"
    _train(run, "cpu", 2, "grpo.per_device_train_batch_size=8", "keep_last=2", "grpo.shard_optimizer_state=true")
    weights = run / "checkpoints" / "step_000002" / "model.safetensors"
    uninterrupted = weights.read_bytes()
    (run / "checkpoints" / "latest").write_text("step_000001")  # as if killed during step 2
    proc = _jetrl_train(2, "--run-dir", str(run), "--resume")
    assert "resumed from" in proc.stdout and "note:" not in proc.stdout
    assert weights.read_bytes() == uninterrupted
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
