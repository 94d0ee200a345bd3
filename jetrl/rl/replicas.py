"""Data parallelism over torchrun: every rank holds the whole model (replicas, not shards).

Why replicas. The rollout engine runs the trainer's own modules on the weights quantized once per
optimizer step (zero weight sync). A replica keeps exactly that: each rank samples its share of
the step's prompts on its own copy, scores and trains on those samples, and the ranks sum their
gradients before every optimizer step. Identical gradients into identical AdamW states keep the
replicas bit-identical: every rank loads the same start (checked), no weight ever moves between
ranks, and each rank's FP8 weight caches are refreshed from its own copy, as on one GPU.
The cost is memory: each GPU holds the model and its gradients (the whole 8B trains on one H200),
and its AdamW state unless ``grpo.shard_optimizer_state`` splits that over the ranks (ZeRO-1,
:meth:`Replicas.optimizer`: each rank updates its share of the parameters and broadcasts it).
Sharding the parameters and gradients too, FSDP-style, would make the rollout gather every BF16
weight before each quantization. ``grpo.shard_weights`` (jetrl/fp8/weight_shard.py) shards them under
an FP8-trained recipe instead: each rank quantizes its own rows once per optimizer step and the ranks
all-gather FP8 codes, the only form of the weight the layers and the rollout read.

The math. Optimizer step g of one RL step sums the losses of its micro-batches m with the loss
type's weights w_m (trainer.py ``_micro_batch_weight``):

    L_g = sum_r sum_{m in M_r,g} w_m * l_m          M_r,g: rank r's micro-batches of step g

and every weight is a function of counts over the *whole* group -- tokens (``dapo``'s
num_items_in_batch), sequences (``grpo``, ``dr_grpo``) or micro-batches (``bnpo``). So each
rank weights its own micro-batches with the counts summed over all ranks (:meth:`Replicas.sum`),
and the all-reduce SUM of the gradients (:meth:`Replicas.reduce_gradients`) is grad L_g, the
gradient one process would compute over the same micro-batches (up to the order of float sums;
tests/test_replicas.py checks it for every loss type). Ranks may hold different numbers of
micro-batches (DAPO's dynamic sampling drops groups per rank): every rank makes the largest
rank's number of optimizer steps, and a rank without micro-batches in step g adds zeros.

Group advantages stay exact: a GRPO group never spans ranks (a rank samples whole prompts), and
``scale_rewards='batch'`` takes its std over every rank's rewards (:meth:`Replicas.gather`). Prompt i
of a step samples with the seed of its index in the whole step, whichever rank holds it, so the
samples do not depend on the number of ranks. On the CPU, where the engine and the trainer are
batch-invariant, N ranks with micro-batches of b therefore train bit for bit as one process with
micro-batches of b and N times the gradient accumulation (tests/test_replicas.py; a sum of two
gradients is exact in either order).

Launch: ``torchrun --nproc_per_node N -m jetrl train ...``. NCCL on CUDA (rank r on
``cuda:LOCAL_RANK``), gloo on the CPU. With one process every method is the identity, so the
single-GPU path runs no collective at all.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from jetrl.fp8.weight_shard import contiguous_share, shard_of

WEIGHT = "@weight"  # metrics[key + WEIGHT]: what metrics[key] averages over, for the merge over ranks
COLLECTIVE_TIMEOUT_MIN = 60  # how long a rank waits in a collective before the job is aborted
BUCKET_ELEMENTS = 1 << 25  # gradients are all-reduced in flat buckets of up to 32M elements (one dtype each)


class Replicas:
    """This process's place among the data-parallel replicas, and the few collectives the trainer needs."""

    def __init__(self, rank: int = 0, world_size: int = 1, device: torch.device | str = "cpu") -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} must be in [0, world_size={world_size})")
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    # ------------------------------------------------------------------ work split
    def shard_range(self, n: int) -> range:
        """The indices of this rank's contiguous block of ``n`` items (the first ``n % world_size`` ranks hold one
        more)."""
        return contiguous_share(n, self.rank, self.world_size)

    # ------------------------------------------------------------------ collectives
    def _reduce(self, values: Sequence[float], op: str) -> list[float]:
        if not self.distributed:
            return [float(v) for v in values]
        import torch.distributed as dist

        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        return t.tolist()

    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum over ranks."""
        return self._reduce(values, "SUM")

    def max(self, values: Sequence[float]) -> list[float]:
        """Element-wise max over ranks."""
        return self._reduce(values, "MAX")

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` (same shape on each), concatenated along dim 0 in rank order."""
        if not self.distributed:
            return tensor
        import torch.distributed as dist

        local = tensor.to(self.device).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local)
        return torch.cat(parts).to(tensor.device)

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()

    @contextlib.contextmanager
    def main_first(self) -> Iterator[None]:
        """Rank 0 runs the block first (e.g. building a cached model), the other ranks after it."""
        if not self.is_main:
            self.barrier()
        yield
        if self.is_main:
            self.barrier()

    # ------------------------------------------------------------------ parameters, gradients, optimizer
    def optimizer(self, params: list[nn.Parameter], cls: type[torch.optim.Optimizer], *, shard: bool = False,
                  **kwargs: Any) -> torch.optim.Optimizer:
        """``cls(params, **kwargs)``; with ``shard`` and more than one rank, ZeRO-1: torch's
        ``ZeroRedundancyOptimizer``, where each rank holds the state of its share of the parameters (whole tensors,
        balanced by size), updates that share from the summed gradients and broadcasts it. The update of each
        parameter is the one ``cls`` makes, so replicas stay bit-identical (tests/test_replicas.py)."""
        if not (shard and self.distributed):
            return cls(params, **kwargs)
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=cls, **kwargs)

    @staticmethod
    def gather_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
        """Before rank 0 saves ``optimizer.state_dict()``: a sharded optimizer gathers its shards there (a
        collective: every rank calls this); a whole one has nothing to do."""
        consolidate = getattr(optimizer, "consolidate_state_dict", None)
        if consolidate is not None:
            consolidate(to=0)

    def reduce_gradients(self, module: nn.Module) -> None:
        """Sum every trainable parameter's gradient over the ranks, in place. A parameter that has a gradient on
        some rank gets one on every rank (zeros where it had none); one without a gradient anywhere keeps None,
        as on one process (AdamW then leaves it alone)."""
        if not self.distributed:
            return
        import torch.distributed as dist

        # a sharded weight's gradient was reduce-scattered in its layer's backward (jetrl/fp8/weight_shard.py)
        params = [p for p in module.parameters() if p.requires_grad and shard_of(p) is None]
        has = self.max([p.grad is not None for p in params])
        grads = []
        for p, any_rank in zip(params, has):
            if any_rank and p.grad is None:
                p.grad = torch.zeros_like(p)
            if any_rank:
                grads.append(p.grad)
        for bucket in _buckets(grads):
            if len(bucket) == 1:
                dist.all_reduce(bucket[0])
                continue
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat)
            for g, part in zip(bucket, flat.split([g.numel() for g in bucket])):
                g.copy_(part.view_as(g))

    def check_in_sync(self, module: nn.Module, when: str) -> None:
        """Raise if the replicas' parameters differ: per parameter, the sum of its bit patterns read as integers
        (no float rounding). They cannot differ unless a rank loaded another start or changed its weights outside
        the trainer; training on would then sum gradients of different models."""
        if not self.distributed:
            return
        whole = [(name, p) for name, p in module.named_parameters() if shard_of(p) is None]  # shards differ by design
        with torch.no_grad():
            local = [_checksum(p.detach()) for _, p in whole]
        every = self.gather_objects(local)
        differ = [name for (name, _), *sums in zip(whole, *every) if len(set(sums)) > 1]
        if differ:
            raise RuntimeError(f"{when}: the data-parallel replicas' weights differ ({len(differ)} parameters, first "
                               f"{differ[0]}): the ranks loaded different starts, or something changed one rank's "
                               "weights outside the trainer; start again, or resume from the last checkpoint")

    def clip_gradients(self, params: list[nn.Parameter], max_norm: float) -> float:
        """The global L2 norm of ``params``' gradients, after scaling them by ``max_norm / norm`` where that is below
        1 (``max_norm`` > 0), as ``torch.nn.utils.clip_grad_norm_`` does. A sharded weight's gradient is one rank's
        rows: its squares are summed over the ranks, a whole parameter's (the same on every rank) counted once."""
        sharded = [p.grad for p in params if shard_of(p) is not None]
        if not sharded:
            if max_norm > 0:
                return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
            return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))
        whole = [p.grad for p in params if shard_of(p) is None]

        def squares(grads: list[torch.Tensor]) -> float:  # one device sync
            return float(torch.stack([g.float().square().sum() for g in grads]).sum()) if grads else 0.0

        norm = math.sqrt(self.sum([squares(sharded)])[0] + squares(whole))
        if max_norm > 0 and math.isfinite(norm):
            coef = min(max_norm / (norm + 1e-6), 1.0)
            if coef < 1.0:
                torch._foreach_mul_([p.grad for p in params], coef)
        return norm

    # ------------------------------------------------------------------ metrics
    def merge_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """One metrics dict for the step from every rank's: a maximum (``*max*``) and a time (``time/*``, the
        slowest rank) over ranks; a mean that comes with its weight (``key + WEIGHT``: its tokens or sequences)
        the weighted mean, so it equals one process's over the same data (up to rounding); anything
        else -- completion-level means, every rank sampling as many completions -- the plain mean. Weights are not
        logged."""
        if not self.distributed:
            return {k: v for k, v in metrics.items() if not k.endswith(WEIGHT)}
        merged: dict[str, float] = {}
        every = self.gather_objects(metrics)
        for key in dict.fromkeys(k for m in every for k in m if not k.endswith(WEIGHT)):
            rows = [m for m in every if isinstance(m.get(key), (int, float))]
            if not rows:
                continue
            values = [m[key] for m in rows]
            weights = [m.get(key + WEIGHT) for m in rows]
            if all(v == values[0] for v in values):  # counters and the shared grad_norm keep their value and type
                merged[key] = values[0]
            elif "max" in key or key.startswith("time/"):
                merged[key] = max(values, key=lambda v: (math.isfinite(v), v))
            elif all(w is not None for w in weights) and sum(weights) > 0:
                merged[key] = sum(v * w for v, w in zip(values, weights) if w) / sum(weights)
            else:
                finite = [v for v in values if math.isfinite(v)] or values
                merged[key] = sum(finite) / len(finite)
        return merged


def with_weight(stats: dict[str, float], weight: float | dict[str, float]) -> dict[str, float]:
    """``stats`` and, for each, the weight :meth:`Replicas.merge_metrics` averages it with over ranks (one for all,
    or one per key)."""
    out = dict(stats)
    for key in stats:
        out[key + WEIGHT] = weight[key] if isinstance(weight, dict) else weight
    return out


def _checksum(t: torch.Tensor, chunk: int = 1 << 24) -> int:
    """The sum of ``t``'s bit patterns read as integers of its width, in chunks (int64 temporaries of at most
    ``chunk`` elements: the 8B's embedding alone would otherwise take 5 GB)."""
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    flat = t.contiguous().view(ints[t.element_size()]).reshape(-1)
    return sum(int(part.sum(dtype=torch.int64)) for part in flat.split(chunk))


def _buckets(grads: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """Consecutive gradients of one dtype and device, up to BUCKET_ELEMENTS elements per bucket."""
    bucket: list[torch.Tensor] = []
    size = 0
    for g in grads:
        if bucket and (g.dtype != bucket[0].dtype or g.device != bucket[0].device
                       or size + g.numel() > BUCKET_ELEMENTS):
            yield bucket
            bucket, size = [], 0
        bucket.append(g)
        size += g.numel()
    if bucket:
        yield bucket


def init_replicas(device: str) -> tuple[Replicas, str]:
    """The replicas of this launch and this rank's device. Under torchrun (``WORLD_SIZE`` > 1) this joins the
    process group: NCCL with rank r on ``cuda:LOCAL_RANK`` when ``device`` is 'auto' or 'cuda' and CUDA is there,
    else gloo on the CPU. A single process gets ``Replicas()`` and ``device`` unchanged."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Replicas(), device
    import torch.distributed as dist

    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device.startswith("cuda:"):
        raise ValueError(f"device={device!r} under torchrun ({world} processes): each rank takes its own GPU "
                         "(cuda:LOCAL_RANK); use device=auto or device=cuda")
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if cuda:
        if not torch.cuda.is_available() or local >= torch.cuda.device_count():
            raise ValueError(f"rank {rank} (LOCAL_RANK={local}) needs GPU {local}, but this torch sees "
                             f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}; run at most that "
                             "many processes per node (--nproc_per_node), or device=cpu")
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    else:
        device = "cpu"
    if not dist.is_initialized():
        # rank 0 alone builds a built-in start's cache and writes checkpoints (tens of GB at 8B) while the others
        # wait in a collective: NCCL's default 10 minutes could abort a run on a slow disk
        dist.init_process_group("nccl" if cuda else "gloo", device_id=torch.device(device) if cuda else None,
                                timeout=datetime.timedelta(minutes=COLLECTIVE_TIMEOUT_MIN))
    if dist.get_world_size() != world:
        raise RuntimeError(f"WORLD_SIZE={world} but the process group has {dist.get_world_size()} ranks")
    return Replicas(dist.get_rank(), world, device), device


def close_replicas(replicas: Replicas) -> None:
    """Leave the process group (the end of a data-parallel run)."""
    if replicas.distributed:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
