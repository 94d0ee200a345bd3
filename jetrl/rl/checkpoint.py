"""Atomic checkpoints of a run, and exact resume.

A checkpoint is a directory ``RUN_DIR/checkpoints/step_000012/`` holding

    config.json, model.safetensors, tokenizer files   an HF-format model dir (``jetrl export`` and
                                                      ``load_pretrained`` read it as is)
    trainer_state.pt                                  optimizer state, step, data position, the
                                                      RNG states (torch, python, numpy) and the
                                                      metrics needed to finish the run's summary

Atomicity: everything is written into ``step_000012.tmp-<pid>/``, fsynced, then renamed to
its final name with ``os.replace`` (atomic on one filesystem); only then is the pointer file
``checkpoints/latest`` replaced the same way. A ``kill -9`` at any instant leaves either the
previous complete checkpoint or the new complete one, never half of one; stale ``*.tmp-*``
dirs are removed at the next save.

Exact resume: the trainer derives every random choice (data order, sampling seeds) from
``(seed, step)`` and keeps master weights and optimizer state in full precision, so loading
a checkpoint and continuing reproduces an uninterrupted run bit for bit on the same machine
(tests/test_trainer.py kills a run with SIGKILL and resumes it; it passes on CPU and on an H200).
On the GPU that rests on two facts measured there: two uninterrupted runs are bit-identical --
with `jetrl train`'s default ``deterministic=true`` (jetrl/run/determinism.py: without it the
embedded default's runs parted ways within 2-19 steps, docs/benchmarks.md runs FM-FU) -- and every
FP8 weight cache follows the optimizer. The latter failed until the trainer tracked its fused AdamW,
which writes parameters without bumping their versions (jetrl/fp8/weight_cache.py): the
uninterrupted run kept the first step's FP8 codes while the resumed one quantized the loaded weights.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from jetrl.models import save_pretrained
from jetrl.rl.shard_state import local_optimizer_state, local_rows

STATE_FILE = "trainer_state.pt"


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint ``latest`` points at, if it is complete, or None. ``latest`` is a file holding a step
    directory's name, as :func:`save_checkpoint` writes it, or a symlink to one."""
    pointer = checkpoint_root(run_dir) / "latest"
    if not pointer.exists():
        return None
    path = pointer.resolve() if pointer.is_dir() else checkpoint_root(run_dir) / pointer.read_text().strip()
    return path if (path / STATE_FILE).exists() else None


def resume_checkpoint(run_dir: str | Path) -> Path:
    """The checkpoint ``--resume`` continues from: the one ``latest`` points at. If that one is incomplete, the error
    names the complete ones to point ``latest`` at instead."""
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is not None:
        return checkpoint
    pointer = checkpoint_root(run_dir) / "latest"
    complete = [p.name for p in _step_dirs(checkpoint_root(run_dir)) if (p / STATE_FILE).is_file()]
    if complete:
        raise FileNotFoundError(
            f"--resume: {pointer} does not point at a complete checkpoint, but {', '.join(complete)} "
            f"{'is' if len(complete) == 1 else 'are'} complete: write the name of the one to resume from into it "
            f"(e.g. echo {complete[-1]} > {pointer})")
    raise FileNotFoundError(f"--resume: {run_dir} has no complete checkpoint to resume from (the run stopped before "
                            "its first one; save_steps sets how often one is written): start it over in another "
                            f"--run-dir, or delete {run_dir} first")


def _step_dirs(root: Path) -> list[Path]:
    """The step directories under ``root``, oldest first (a half-written ``*.tmp-<pid>`` one is not one)."""
    return sorted(p for p in root.glob("step_*") if p.is_dir() and ".tmp-" not in p.name)


def save_checkpoint(run_dir: str | Path, step: int, model: nn.Module, tokenizer: Any, optimizer: torch.optim.Optimizer,
                    state: dict[str, Any], keep_last: int = 2,
                    whole: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None) -> Path:
    """Write checkpoint ``step`` atomically and point ``latest`` at it; keep the last ``keep_last``. ``whole``: the
    gathered tensors of sharded weights and the optimizer state with them (jetrl/rl/shard_state.py), written
    in place of the model's and optimizer's own."""
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob("*.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    name = f"step_{step:06d}"
    tmp = root / f"{name}.tmp-{os.getpid()}"
    tensors, optimizer_state = whole if whole is not None else ({}, optimizer.state_dict())
    save_pretrained(model, model.config, tmp, dtype=next(model.parameters()).dtype, replace=tensors)
    if tokenizer is not None:  # jetrl's Tokenizer (.save) or an HF tokenizer (.save_pretrained)
        (getattr(tokenizer, "save", None) or tokenizer.save_pretrained)(str(tmp))
    payload = {
        "step": step,
        "optimizer": optimizer_state,
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
        **state,
    }
    torch.save(payload, tmp / STATE_FILE)
    _fsync_dir(tmp)
    final = root / name
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _atomic_write(root / "latest", name)
    done = _step_dirs(root)
    for old in done[:-keep_last] if keep_last > 0 else []:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def load_trainer_state(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Restore model weights (in place), optimizer and RNG states from checkpoint ``path``; return its state."""
    from safetensors import safe_open

    path = Path(path)
    try:
        # memory-mapped, and the weights read one tensor at a time: N data-parallel ranks resuming on one node share
        # the page cache instead of each holding the whole optimizer state and model in its own memory
        state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False, mmap=True)
        files = [safe_open(str(file), "pt") for file in sorted(path.glob("*.safetensors"))]
        where = {name: f for f in files for name in f.keys()}  # noqa: SIM118 -- safe_open objects are not iterable
    except Exception as err:  # torch, pickle and safetensors each raise their own type for a bad file
        raise ValueError(_damaged(path, err)) from err
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name not in where:
                if name == "lm_head.weight" and model.config.tie_word_embeddings:
                    continue
                raise ValueError(f"checkpoint {path} has no tensor {name!r}; was it written by another model?")
            try:
                tensor = where[name].get_tensor(name)
            except Exception as err:  # a truncated file fails here, not at open
                raise ValueError(_damaged(path, err)) from err
            param.copy_(local_rows(param, tensor).to(param.dtype))  # a sharded weight: this rank's rows
    optimizer.load_state_dict(local_optimizer_state(optimizer, state["optimizer"]))
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    np.random.set_state(state["rng"]["numpy"])
    return state


def _damaged(path: Path, err: Exception) -> str:
    """The message for a checkpoint that cannot be read: which one, why, and the older ones to resume from instead."""
    older = [p.name for p in _step_dirs(path.parent) if p != path]
    hint = (f"resume from an older one by writing its name ({', '.join(older)}) into {path.parent / 'latest'}"
            if older else "no older checkpoint is kept; start the run again")
    return f"checkpoint {path} cannot be read ({type(err).__name__}: {str(err).splitlines()[0][:200]}): {hint}"


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    for file in path.iterdir():
        if file.is_file():
            with open(file, "rb") as f:
                os.fsync(f.fileno())
