"""Checkpoints of sharded FP8 weights (jetrl/fp8/weight_shard.py) in the format of a whole model.

A checkpoint holds whole tensors whatever the run's layout. The ranks all-gather each sharded master and each of its
AdamW moments in turn (one whole tensor on the device at a time), and rank 0 keeps them on its host until it writes
them as one process would: about 3x the FP8 layers' BF16 bytes of host memory on rank 0 (~190 GB at 32B). A resume
takes each rank's rows back. So a checkpoint
of a sharded run resumes with or without sharding and on any number of ranks, ``jetrl export`` and ``jetrl eval
--run`` read it as any other, and a replicas checkpoint resumes sharded.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from jetrl.fp8.weight_shard import shard_of


def _indexed(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    """The optimizer's parameters in the order of its state dict's indices."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def whole_state(model: nn.Module, optimizer: torch.optim.Optimizer, main: bool
                ) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    """On rank 0 (``main``): the whole tensors of ``model``'s sharded parameters ({state-dict name: CPU tensor}) and
    ``optimizer.state_dict()`` with their moments whole; None on the others. A collective: every rank calls it."""
    tensors = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            shard = shard_of(param)
            if shard is not None:
                full = shard.whole(param.detach())
                if main:
                    tensors[name] = full.cpu()
        state = optimizer.state_dict()  # its per-parameter dicts are the optimizer's own: replaced, not changed
        state["state"] = dict(state["state"])
        for index, param in enumerate(_indexed(optimizer)):
            shard = shard_of(param)
            if shard is None or index not in state["state"]:
                continue
            moments = dict(state["state"][index])
            for key, value in moments.items():
                if torch.is_tensor(value) and value.shape == param.shape and value.dim() == 2:
                    full = shard.whole(value)
                    moments[key] = full.cpu() if main else None
            state["state"][index] = moments
    return (tensors, state) if main else None


def local_rows(param: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """What a checkpoint's whole tensor is on this rank: its rows for a sharded parameter, else itself."""
    shard = shard_of(param)
    if shard is None:
        return whole
    if tuple(whole.shape) != shard.full_shape:
        raise ValueError(f"{shard.name}: the checkpoint holds shape {tuple(whole.shape)}, the model {shard.full_shape}")
    return shard.local(whole)


def local_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """A whole optimizer state dict (:func:`whole_state`'s, or a replicas run's) with each sharded parameter's moments
    cut to this rank's rows, ready for ``optimizer.load_state_dict``."""
    params = _indexed(optimizer)
    out = {**state, "state": dict(state["state"])}
    for index, moments in state["state"].items():
        param = params[index] if index < len(params) else None
        if param is not None and shard_of(param) is not None:
            out["state"][index] = {key: local_rows(param, value) if torch.is_tensor(value) and value.dim() == 2
                                   else value for key, value in moments.items()}
    return out
