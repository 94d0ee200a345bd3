"""Sharded FP8 master weights: each data-parallel rank holds 1/N of every FP8 layer's BF16 weight.

Why. A replica (jetrl/rl/replicas.py) holds per parameter of an FP8 layer its BF16 master (2 bytes), its BF16
gradient (2), its AdamW moments (4, in the master's dtype) and the FP8 codes of W and W^T the trainer and the
rollout read (2): 10 bytes, 6 + 4/N with ZeRO-1. On 8 GPUs a 32B model so needs 208 GB per GPU, more than an H200
holds. Sharding the master, its gradient and its moments over N ranks leaves 2 + 8/N bytes (32B on 8 GPUs: 96 GB).

Why this needs no weight gather in forward or backward, unlike FSDP. Under an FP8-trained recipe (``jet``,
``jet_kv``) a layer's three GEMMs never read the BF16 weight:

    fprop  Y  = q(X) . q(W)^T        dgrad  dX = q(dY) . q(W)        wgrad  dW = q(dY^T) . q(X^T)^T

only its codes q(W) (and their transpose), which the weight cache holds for a whole optimizer step. So every rank
keeps the full codes (1 byte per element, as the rollout needs them anyway: zero weight sync still holds) and
only the master is split. The split is by row blocks of the weight's 128 x 128 quantization blocks, rank r owning
the rows R_r (the block rows of :meth:`~jetrl.rl.replicas.Replicas.shard_range`):

* **Refresh (once per optimizer step).** Each block is quantized from its own values only, so
  q(W)[R_r] = q(W[R_r]): each rank quantizes its own rows with the one quantizer and an all-gather of codes and
  scales assembles q(W) on every rank, bit-identical to quantizing the whole W -- half the bytes of gathering the
  BF16 weights, and no rank ever holds them.
* **Gradients (every micro-batch).** A layer's backward computes this rank's dW over the whole weight and
  reduce-scatters it: rank r keeps sum over ranks of dW[R_r], accumulated into its shard's gradient. One layer's dW
  (one projection group's) is alive at a time. The replicas' all-reduce at the optimizer step sums the same terms,
  in another order when a rank holds several micro-batches per optimizer step (rounding-level differences).
* **Update.** AdamW is element-wise: rank r's update of R_r is the rows R_r of the whole update.

The price is lockstep: a collective in every layer's backward means every rank runs as many backward passes per
optimizer step, in the same layer order (the trainer pads a rank with fewer micro-batches with zero-weighted ones),
and the gathers run only inside :func:`~jetrl.fp8.convert.refresh_weight_caches`, which every rank calls together
(after each optimizer step, and on resume). A cache found stale anywhere else raises instead of hanging the other
ranks in a collective. Collectives pair by their order, so the trainer also compares each rank's sequence of
reduced weights at every optimizer step (:func:`take_reduction_checksum`).
"""

from __future__ import annotations

import contextlib
import threading
import zlib
from collections.abc import Iterator

import torch
from torch import nn

from jetrl.fp8.quant import E4M3, Float8Blocks, assert_finite, quantize

SHARD_ATTR = "jetrl_shard"  # set on a sharded parameter: its WeightShard


class _Gathers(threading.local):
    allowed: bool = False


_gathers = _Gathers()


class _Reductions:  # not thread-local: autograd runs a CUDA backward on a thread of its own
    checksum = 0  # of the names of the weights reduced since the last take_reduction_checksum, in order


_reductions = _Reductions()


def take_reduction_checksum() -> int:
    """A checksum (< 2**32) of the sequence of weights whose gradients this rank reduce-scattered since the last
    call, and start a new one. Backward collectives pair by their order, and two layers of one shape (k_proj, v_proj)
    would pair silently with each other's: the trainer compares this over the ranks at every optimizer step."""
    value, _reductions.checksum = _reductions.checksum, 0
    return value


@contextlib.contextmanager
def weight_gathers() -> Iterator[None]:
    """The block where a sharded weight's cache may gather (every rank enters it together:
    :func:`~jetrl.fp8.convert.refresh_weight_caches`)."""
    outer = _gathers.allowed
    _gathers.allowed = True
    try:
        yield
    finally:
        _gathers.allowed = outer


class WeightShard:
    """Rank ``rank``'s rows of a weight of ``full_shape`` split over ``world`` ranks in blocks of ``block_rows``, and
    the two collectives on them. One process (``world`` 1) holds every row and communicates nothing."""

    def __init__(self, full_shape: tuple[int, int], block_rows: int, rank: int, world: int, name: str) -> None:
        self.full_shape, self.block_rows, self.name = tuple(full_shape), block_rows, name
        self.rank, self.world = rank, world
        blocks = -(-full_shape[0] // block_rows)
        self.blocks_per_rank = -(-blocks // world)  # the collectives' equal chunk (the last ranks' are padded)
        self.block_ranges = [contiguous_share(blocks, r, world) for r in range(world)]
        self.row_ranges = [range(min(b.start * block_rows, full_shape[0]), min(b.stop * block_rows, full_shape[0]))
                           for b in self.block_ranges]
        self.rows, self.block_range = self.row_ranges[rank], self.block_ranges[rank]
        # whether the ranks' row chunks are equal and tile the weight: then the collectives work in place
        self.even = full_shape[0] == world * self.blocks_per_rank * block_rows

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full-shape tensor (a view)."""
        return full[self.rows.start:self.rows.stop]

    # ------------------------------------------------------------------ refresh: quantize own rows, gather codes
    def quantize(self, shard: torch.Tensor, block: tuple[int, int], *, pow2_scale: bool, check_finite: bool,
                 out: Float8Blocks | None) -> Float8Blocks:
        """q(W) on every rank from this rank's rows ``shard`` = W[R_r]: each quantizes its rows into its slice of the
        full buffers (``out``, or new ones), then the slices are all-gathered. Equal to ``quantize(W, block)``."""
        if not _gathers.allowed and self.world > 1:
            raise RuntimeError(
                f"{self.name}: its sharded FP8 weight is stale outside refresh_weight_caches, so this rank alone "
                "would start a collective the others never join; with grpo.shard_weights every rank refreshes the "
                "weight caches together (jetrl.fp8.refresh_weight_caches) after any write to the weights")
        if tuple(shard.shape) != (len(self.rows), self.full_shape[1]):
            raise ValueError(f"{self.name}: shard of shape {tuple(shard.shape)}, expected rows {self.rows} of "
                             f"{self.full_shape}")
        if out is None:
            rows, cols = self.full_shape
            out = Float8Blocks(torch.empty(rows, cols, dtype=E4M3, device=shard.device),
                               torch.empty(-(-rows // block[0]), -(-cols // block[1]), dtype=torch.float32,
                                           device=shard.device), tuple(block))
        mine = Float8Blocks(self.local(out.codes), out.scales[self.block_range.start:self.block_range.stop],
                            tuple(block))
        if len(self.rows):
            quantize(shard, block, pow2_scale=pow2_scale, name=self.name, out=mine)
        self.gather_rows(out.codes.view(torch.uint8), mine.codes.view(torch.uint8), self.block_rows)  # gloo has no fp8
        self.gather_rows(out.scales, mine.scales, 1)
        if check_finite:  # on the whole weight: every rank raises alike
            assert_finite(out, self.name)
        return out

    def gather_rows(self, full: torch.Tensor, mine: torch.Tensor, rows_per_block: int) -> None:
        """Every rank's slice of ``full`` (block rows of ``rows_per_block`` rows) from its holder, in place; ``mine``
        is this rank's (a collective)."""
        if self.world == 1:
            return
        chunk = self.blocks_per_rank * rows_per_block
        if self.even:
            _collective("all_gather_into_tensor", full, mine.contiguous())
            return
        staged = full.new_zeros((self.world * chunk, *full.shape[1:]))
        staged[self.rank * chunk: self.rank * chunk + mine.shape[0]] = mine
        _collective("all_gather_into_tensor", staged, staged[self.rank * chunk: (self.rank + 1) * chunk].clone())
        for r, blocks in enumerate(self.block_ranges):
            start, stop = blocks.start * rows_per_block, min(blocks.stop * rows_per_block, full.shape[0])
            full[start:stop] = staged[r * chunk: r * chunk + stop - start]

    def whole(self, mine: torch.Tensor) -> torch.Tensor:
        """The full-shape tensor whose rows this rank holds as ``mine`` (e.g. the master, an AdamW moment) on every
        rank (a collective)."""
        full = mine.new_empty((self.full_shape[0], *mine.shape[1:]))
        self.local(full).copy_(mine)
        self.gather_rows(full, self.local(full), self.block_rows)
        return full

    # ------------------------------------------------------------------ backward: reduce-scatter dW
    def reduce(self, grad: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the sum over ranks of the full-shape ``grad`` (a new tensor)."""
        _reductions.checksum = zlib.crc32(self.name.encode(), _reductions.checksum)
        if self.world == 1:
            return grad
        chunk = self.blocks_per_rank * self.block_rows
        grad = grad.contiguous()
        if not self.even:
            padded = grad.new_zeros((self.world * chunk, grad.shape[1]))
            for r, rows in enumerate(self.row_ranges):
                padded[r * chunk: r * chunk + len(rows)] = grad[rows.start:rows.stop]
            grad = padded
        out = grad.new_empty((chunk, grad.shape[1]))
        _collective("reduce_scatter_tensor", out, grad)
        return out if len(self.rows) == chunk else out[:len(self.rows)].clone()  # no padded chunk kept as .grad


def _through_host(t: torch.Tensor) -> bool:
    """Whether a collective on ``t`` goes through host copies: gloo on a CUDA tensor (two ranks sharing one GPU in
    the tests; a GPU run uses NCCL)."""
    import torch.distributed as dist

    return t.is_cuda and dist.get_backend() == "gloo"


def _collective(op: str, out: torch.Tensor, inp: torch.Tensor) -> None:
    """``torch.distributed``'s ``all_gather_into_tensor`` or ``reduce_scatter_tensor`` (``op``) of ``inp`` into
    ``out``, through host copies where gloo holds CUDA tensors."""
    import torch.distributed as dist

    run = getattr(dist, op)
    if _through_host(out):
        host = out.cpu()
        run(host, inp.cpu())
        out.copy_(host)
    else:
        run(out, inp)


def contiguous_share(n: int, rank: int, world: int) -> range:
    """Rank ``rank``'s contiguous block of ``n`` items, the first ``n % world`` ranks holding one more (also the split
    of a step's prompts over the ranks: Replicas.shard_range)."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def shard_of(param: torch.Tensor) -> WeightShard | None:
    """The :class:`WeightShard` of a sharded parameter, None for a whole one."""
    return getattr(param, SHARD_ATTR, None)


def sharded_parameters(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if shard_of(p) is not None]


def shard_fp8_weights(model: nn.Module, rank: int, world: int) -> int:
    """Replace the weight of every FP8-trained ``Float8Linear`` of ``model`` by rank ``rank``'s rows of it (module
    docstring) and point its weight cache at the :class:`WeightShard`; returns how many. Every rank calls this on the
    same model (the ranks' replicas are checked equal before). The caches are filled first, from the whole weights,
    and keep those codes: the shards hold the same values, so no collective runs here. Raises if the recipe trains
    or rolls out on BF16 weights, which a rank holding a shard could not compute."""
    from jetrl.fp8.convert import float8_modules, reads_only_codes, refresh_weight_caches

    modules = float8_modules(model)
    if not modules:
        raise ValueError("grpo.shard_weights: the model has no FP8 layers (recipe bf16?): shard under an FP8-trained "
                         "recipe (jet, jet_kv), or keep replicas (grpo.shard_weights=false) with "
                         "grpo.shard_optimizer_state=true")
    for fqn, module in modules.items():
        train, rollout = module.recipe.train.weight, module.recipe.rollout.weight
        if shard_of(module.weight) is not None:
            raise ValueError(f"{fqn}: its weight is sharded already (a second trainer on the same model?); build "
                             "the model again")
        if not reads_only_codes(module):
            raise ValueError(f"grpo.shard_weights: {fqn} under recipe {module.recipe.name!r} reads its BF16 weight "
                             f"(training {'BF16' if train is None else 'FP8'}, rollout "
                             f"{'BF16' if rollout is None else 'FP8'}), which a rank holding 1/{world} of it cannot "
                             "compute; shard under an FP8-trained recipe (jet, jet_kv), or keep replicas "
                             "(grpo.shard_weights=false) with grpo.shard_optimizer_state=true")
    refresh_weight_caches(model)
    for fqn, module in modules.items():
        spec = module.recipe.train.weight
        full = module.weight
        cache = module.weight_cache
        shard = WeightShard(tuple(full.shape), spec.block[0], rank, world, f"{fqn}.weight")
        current = cache.is_current(full, spec)
        part = nn.Parameter(shard.local(full.detach()).clone(), requires_grad=full.requires_grad)
        setattr(part, SHARD_ATTR, shard)
        module.weight = part
        cache.shard = shard
        if current:  # the held codes are q(W), the shards' gather: keep them (a primed checkpoint's exact bits too)
            cache.rekey(part, spec)
    return len(modules)
