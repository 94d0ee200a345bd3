"""Sharded FP8 master weights (jetrl/fp8/weight_shard.py, grpo.shard_weights) over two gloo ranks.

The claims under test: the codes every rank gathers are bit-identical to quantizing the whole weight (even and
uneven row splits, a rank without rows, partial blocks, power-of-two scales); a layer's reduce-scattered gradient is
its rows of the sum over ranks; a stale sharded cache outside a refresh raises instead of hanging; a trainer update
with sharded weights ends with the very weights the replicas reach, with uneven micro-batches per rank (the lockstep's
zero-weighted passes) and with an empty rank, and within rounding with the gradient clipped (its norm sums the shards'
squares); a whole `torchrun -m jetrl train` run of two sharded ranks ends bit for bit where one process does, its
checkpoint holds whole tensors, and a resume from it continues bit for bit. On one GPU (gloo, both ranks on it) the
CUDA path -- the Triton quantizer, the stacked q/k/v and gate/up GEMMs -- does the same.
"""

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file

from jetrl.data import synthetic_split
from jetrl.fp8.quant import quantize
from jetrl.fp8.weight_shard import WeightShard, shard_of, take_reduction_checksum, weight_gathers
from jetrl.models.llama import CausalLM
from jetrl.models.tiny import build_tiny_tokenizer, tiny_model_config
from jetrl.models.tokenizer import Tokenizer
from jetrl.rl.config import GRPOConfig
from jetrl.rl.replicas import Replicas
from jetrl.rl.trainer import GRPOTrainer
from tests.test_replicas import _batch, _check_run_of_two_ranks, _jetrl_train, _train

SHAPES = [(256, 256), (384, 128), (64, 128), (200, 130)]  # even; 3 blocks on 2 ranks; rank 1 empty; partial blocks


def _check_collectives(rank: int, device: str) -> list[str]:
    """Gathered codes against the whole weight's, and the reduce-scatter against the sum; returns what differed."""
    problems = []
    for i, shape in enumerate(SHAPES):
        for pow2 in (False, True):
            g = torch.Generator().manual_seed(2 * i + pow2)
            weight = (torch.randn(shape, generator=g) * 0.05).to(device=device, dtype=torch.bfloat16)
            grads = [torch.randn(shape, generator=g).to(device=device, dtype=torch.bfloat16) for _ in range(2)]
            shard = WeightShard(shape, 128, rank, 2, f"w{shape}")
            with weight_gathers():
                got = shard.quantize(shard.local(weight).clone(), (128, 128), pow2_scale=pow2, check_finite=True,
                                     out=None)
            want = quantize(weight, (128, 128), pow2_scale=pow2)
            if not (torch.equal(got.codes.view(torch.uint8), want.codes.view(torch.uint8))
                    and torch.equal(got.scales, want.scales)):
                problems.append(f"{shape} pow2={pow2}: gathered codes differ from the whole weight's")
            reduced = shard.reduce(grads[rank])
            if not torch.equal(reduced, shard.local(grads[0] + grads[1])):
                problems.append(f"{shape}: the reduce-scattered gradient is not the sum's rows")
            if not torch.equal(shard.whole(shard.local(weight).clone()), weight):
                problems.append(f"{shape}: whole() differs from the weight")
    shard = WeightShard((256, 128), 128, rank, 2, "w")
    try:
        shard.quantize(torch.zeros(128, 128, device=device), (128, 128), pow2_scale=False, check_finite=False,
                       out=None)
        problems.append("a gather outside refresh_weight_caches did not raise")
    except RuntimeError as err:
        if "outside refresh_weight_caches" not in str(err):
            problems.append(f"unexpected error: {err}")
    return problems


def _trainer(replicas: Replicas, shard: bool, max_grad_norm: float, accumulation: int = 1) -> GRPOTrainer:
    torch.manual_seed(0)
    args = GRPOConfig(learning_rate=1e-3, num_generations=2, generation_batch_size=16, per_device_train_batch_size=2,
                      gradient_accumulation_steps=accumulation, max_prompt_length=32, max_completion_length=8,
                      max_grad_norm=max_grad_norm, old_logprobs="recompute", shard_weights=shard,
                      train_cuda_graphs="off")  # sharding turns them off; graphed layers would plan other micro-batches
    train, _ = synthetic_split(16, 0, 0)
    return GRPOTrainer(CausalLM(tiny_model_config()).to(replicas.device), "math", args, train,
                       tokenizer=Tokenizer(build_tiny_tokenizer()), recipe="jet", replicas=replicas)


def _whole_weights(trainer: GRPOTrainer) -> list[torch.Tensor]:
    with torch.no_grad():
        return [(p if shard_of(p) is None else shard_of(p).whole(p)).detach().cpu().clone()
                for p in trainer.model.parameters()]


def _update(replicas: Replicas, shard: bool, rows, max_grad_norm: float = 0.0, accumulation: int = 1) -> dict:
    """The whole gradient of each optimizer step and the whole weights after one `_update` over ``rows`` of the fixed
    batch (None: this rank has none), and its grad_norm."""
    trainer = _trainer(replicas, shard, max_grad_norm, accumulation)
    assert trainer.sharded == shard and shard == any(shard_of(p) is not None for p in trainer.model.parameters())
    grads: list[list[torch.Tensor]] = []  # a sharded one gathered: every rank runs the hook, in the same order
    trainer.optimizer.register_step_pre_hook(lambda opt, *_: grads.append(
        [(p.grad if shard_of(p) is None else shard_of(p).whole(p.grad)).detach().cpu().clone()
         for p in trainer.model.parameters()]))
    before = _whole_weights(trainer)
    batch = None if rows is None else _batch(rows)
    if batch is not None:
        trainer._old_logprobs(batch, {})
    metrics = {}
    trainer._update(batch, metrics)
    after = _whole_weights(trainer)
    assert any(not torch.equal(a, b) for a, b in zip(before, after)), "the update moved no weight (an empty check)"
    return {"grads": grads, "weights": after, "grad_norm": metrics.get("grad_norm", float("nan"))}


def _worker(rank: int, store: str, out: str, device: str) -> None:
    import torch.distributed as dist

    from jetrl.run.determinism import deterministic_algorithms

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        with deterministic_algorithms():  # on CUDA: two runs of one update give the same bits
            replicas = Replicas(rank, 2, device)
            result = {"collectives": _check_collectives(rank, device)}
            cases = {  # rank 0: 2 micro-batches (2 optimizer steps), rank 1: 1 -- its second is a zero-weighted pass
                "uneven": slice(0, 4) if rank == 0 else slice(4, 6),
                "empty_rank": slice(0, 4) if rank == 0 else None,
            }
            for name, rows in cases.items():
                result[name] = [_update(replicas, shard, rows) for shard in (False, True)]
            rows = slice(4 * rank, 4 * rank + 4)
            result["clipped"] = [_update(replicas, shard, rows, max_grad_norm=1e-3) for shard in (False, True)]
            # one optimizer step of 2 micro-batches per rank; then rank 1 with 1 of them (a zero-weighted pass within
            # the step): the shards sum micro-batch by micro-batch, the replicas rank by rank -- to rounding
            result["accumulated"] = [_update(replicas, shard, rows, accumulation=2) for shard in (False, True)]
            rows = slice(0, 4) if rank == 0 else slice(4, 6)
            result["fewer_in_step"] = [_update(replicas, shard, rows, accumulation=2) for shard in (False, True)]
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_sharded_weights_over_two_ranks(tmp_path, device):
    torch.multiprocessing.spawn(_worker, args=(str(tmp_path / "store"), str(tmp_path), device), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for rank in ranks:
        assert rank["collectives"] == []
    for name in ("uneven", "empty_rank"):
        whole, sharded = ranks[0][name]
        assert len(whole["grads"]) == len(sharded["grads"]) == 2, f"{name}: optimizer steps"
        for step, (ref, got) in enumerate(zip(whole["grads"], sharded["grads"])):
            for i, (a, b) in enumerate(zip(ref, got, strict=True)):
                assert a.abs().max() > 0, f"{name}: parameter {i} has a zero gradient (an empty check)"
                if device == "cpu":  # batch-invariant: the same sums, bit for bit
                    assert torch.equal(a, b), f"{name}, step {step}: parameter {i}'s gradient differs"
                else:  # cuBLAS and the Triton kernels round as they tile; AdamW's first steps turn that into lr
                    err = float((a - b).abs().max() / a.abs().max())
                    assert err < 1e-5, f"{name}, step {step}, parameter {i}: max error {err:.2e} of its max"
        if device == "cpu":
            for i, (a, b) in enumerate(zip(whole["weights"], sharded["weights"], strict=True)):
                assert torch.equal(a, b), f"{name}: parameter {i} differs from the replicas' update"
        for i, (a, b) in enumerate(zip(sharded["weights"], ranks[1][name][1]["weights"])):
            assert torch.equal(a, b), f"{name}: the ranks' gathered weights differ at parameter {i}"
    for name in ("accumulated", "fewer_in_step"):
        whole, sharded = ranks[0][name]
        assert len(whole["grads"]) == len(sharded["grads"]) == 1, f"{name}: optimizer steps"
        for i, (a, b) in enumerate(zip(whole["grads"][0], sharded["grads"][0], strict=True)):
            assert a.abs().max() > 0, f"{name}: parameter {i} has a zero gradient (an empty check)"
            err = float((a - b).abs().max() / a.abs().max())
            assert err < 1e-5, f"{name}: parameter {i}: max error {err:.2e} of its max"
    whole, sharded = ranks[0]["clipped"]
    assert sharded["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-5) and whole["grad_norm"] > 1e-3
    if device == "cpu":  # clipped: the norm is summed in another order, and the coefficient with it
        for a, b in zip(whole["weights"], sharded["weights"], strict=True):
            assert float((a - b).abs().max()) <= 1e-6 * max(float(a.abs().max()), 1.0)


def test_the_reduction_checksum_follows_the_order():
    """What the trainer compares over the ranks at each optimizer step: the sequence of reduced weights, in order
    (one process: the reduction is the identity, the checksum still counts)."""
    take_reduction_checksum()
    k, v = WeightShard((64, 128), 128, 0, 1, "k_proj"), WeightShard((64, 128), 128, 0, 1, "v_proj")
    grad = torch.ones(64, 128)
    sums = []
    for order in ((k, v), (v, k), (k, v)):
        for shard in order:
            assert shard.reduce(grad) is grad
        sums.append(take_reduction_checksum())
    assert sums[0] == sums[2] != sums[1] and take_reduction_checksum() == 0


def test_shard_weights_configuration_errors():
    with pytest.raises(ValueError, match="shards the FP8 layers' AdamW state already"):
        GRPOConfig(shard_weights=True, shard_optimizer_state=True)
    from jetrl.fp8 import convert_to_float8, get_recipe
    from jetrl.fp8.weight_shard import shard_fp8_weights

    model = convert_to_float8(CausalLM(tiny_model_config()), get_recipe("fp8_rollout"))  # trains on BF16 weights
    with pytest.raises(ValueError, match="reads its BF16 weight"):
        shard_fp8_weights(model, 0, 2)
    with pytest.raises(ValueError, match="no FP8 layers"):
        shard_fp8_weights(convert_to_float8(CausalLM(tiny_model_config()), get_recipe("bf16")), 0, 2)
    model = convert_to_float8(CausalLM(tiny_model_config()), get_recipe("jet"))
    shard_fp8_weights(model, 0, 2)  # no collective: the caches are filled from the whole weights, then re-keyed
    with pytest.raises(ValueError, match="sharded already"):
        shard_fp8_weights(model, 0, 2)


def test_two_sharded_ranks_train_and_resume_bit_for_bit_as_one_process(tmp_path):
    """Two ranks with sharded weights (the gradient unclipped: its norm sums shards in another order) and a KL term
    end a run with the very weights of one process; the checkpoint holds whole tensors, a resume continues bit for
    bit, and one process resumes it too."""
    two, one = tmp_path / "two", tmp_path / "one"
    # with a KL term: the reference, copied whole before the policy is sharded, keeps codes only (frozen.py)
    options = ("grpo.per_device_train_batch_size=8", "grpo.max_grad_norm=0", "keep_last=2", "grpo.beta=0.05")
    with ThreadPoolExecutor(2) as pool:  # the option has no effect on one process, and says so
        one_run = pool.submit(_train, one, "cpu", 1, "grpo.gradient_accumulation_steps=2", "grpo.shard_weights=true",
                              *options)
        _check_run_of_two_ranks(two, _train(two, "cpu", 2, "grpo.shard_weights=true", *options), pruned=False)
        assert "grpo.shard_weights=true has no effect on one process" in one_run.result().stdout
    weights = "checkpoints/step_000002/model.safetensors"
    assert (two / weights).read_bytes() == (one / weights).read_bytes()
    uninterrupted = (two / weights).read_bytes()
    (two / "checkpoints" / "latest").write_text("step_000001")  # as if killed during step 2
    alone = tmp_path / "alone"  # the same checkpoint, resumed by one process: another rank count, no shards
    shutil.copytree(two, alone)
    with ThreadPoolExecutor(2) as pool:
        resumed_alone = pool.submit(_jetrl_train, 1, "--run-dir", str(alone), "--resume")
        proc = _jetrl_train(2, "--run-dir", str(two), "--resume")
        resumed_alone = resumed_alone.result()
    assert "resumed from" in proc.stdout
    assert (two / weights).read_bytes() == uninterrupted
    assert [json.loads(line)["step"] for line in (two / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    # one process reads the whole tensors rank 0 gathered; its step 2 has another batch split (per-device 8 of 16
    # completions on one rank: two optimizer steps), so it continues, but not to the same bits
    summary = json.loads(resumed_alone.stdout.splitlines()[-1])
    assert "resumed from" in resumed_alone.stdout and summary["steps"] == 2
    assert summary.get("data_parallel_ranks", 1) == 1
    rows = [json.loads(line) for line in (alone / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2] and rows[-1]["optimizer_steps"] == rows[0]["optimizer_steps"] + 2
    resumed_weights = load_file(str(alone / weights))
    assert all(torch.isfinite(w).all() for w in resumed_weights.values())
    assert resumed_weights.keys() == load_file(str(two / weights)).keys()
