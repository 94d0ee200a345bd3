"""The built tiny start on disk: the copy the package ships, what a build writes (:func:`train_tiny_start`) and the
cache around other builds.

Why ship the default build: the build takes 2.5-5 minutes on 2 cores, every default run needs it, and a build is
deterministic on one machine only (another CPU or torch build gives other bits). So the package carries the default
start (seed 0, the default SFT config; ``start/``, 1.6 MB of fp32 weights, built by
``tiny_start_checkpoint(force=True)`` on a 2-core CPU with torch 2.13): a fresh machine runs ``jetrl train`` at once,
and every machine starts RL from the same weights. A test fails when the SFT config or ``TINY_VERSION`` moves away from
the shipped copy's.

Why a cache with atomic builds for the rest (another seed or SFT config, or ``force``): a killed or concurrent build
must never leave a half-written checkpoint that a later run trusts. A cached build is valid while its
``tiny_start.json`` matches the kind, version, seed and SFT config asked for.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from jetrl.models.export import unwritable
from jetrl.models.loader import save_pretrained
from jetrl.models.tiny.evaluate import evaluate_tiny
from jetrl.models.tiny.sft import TinySFTConfig, _sft
from jetrl.models.tiny.task import SPLIT_SEED

TINY_KIND = "tiny-adder"
TINY_VERSION = 1
META_NAME = "tiny_start.json"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", META_NAME)
SHIPPED_DIR = Path(__file__).with_name("start")
"""The default start the package ships (seed 0, ``TinySFTConfig()``)."""


def cache_root() -> Path:
    """``$JETRL_CACHE`` (default ``~/.cache/jetrl``)."""
    return Path(os.environ.get("JETRL_CACHE") or "~/.cache/jetrl").expanduser()


def train_tiny_start(out_dir: str | Path, *, seed: int = 0, sft: TinySFTConfig | None = None,
                     log_every: int = 0, device: str | torch.device = "cpu") -> dict[str, Any]:
    """SFT the tiny start from scratch and save it (weights fp32, tokenizer, ``tiny_start.json``) to ``out_dir``.

    Deterministic given ``seed`` on one machine (same torch build and thread count). Returns the
    metadata written to ``tiny_start.json`` (config, timings, held-out accuracies).
    """
    cfg = sft or TinySFTConfig()
    out_dir = Path(out_dir)
    t0 = time.perf_counter()
    prev_threads = torch.get_num_threads()
    # fork_rng: the build seeds torch's global RNG; the caller's RNG state is restored afterwards.
    with torch.random.fork_rng(devices=[]):
        try:
            model, tok, mcfg, train, held_out, train_s, thread_steps = _sft(cfg, seed, log_every, device, t0)
            model.eval()
            evals = held_out[: cfg.eval_problems]
            greedy = evaluate_tiny(model, tok, evals, temperature=0.0, mistake_offset=cfg.mistake_offset)
            sampled = evaluate_tiny(model, tok, evals, temperature=1.0, samples=cfg.eval_samples, seed=seed,
                                    mistake_offset=cfg.mistake_offset)
        finally:
            if torch.get_num_threads() != prev_threads:
                torch.set_num_threads(prev_threads)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_pretrained(model.cpu(), mcfg, out_dir, dtype=torch.float32)
    tok.save_pretrained(str(out_dir))
    meta = {
        "kind": TINY_KIND,
        "version": TINY_VERSION,
        "seed": seed,
        "sft": asdict(cfg),
        "split": {"seed": SPLIT_SEED, "num_train": len(train), "num_eval": len(held_out)},
        "train_s": round(train_s, 1),
        "sft_steps_per_thread_count": {str(k): v for k, v in sorted(thread_steps.items())},
        "held_out_problems": len(evals),
        "greedy": greedy,
        "sampled": sampled,
    }
    (out_dir / META_NAME).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    for f in out_dir.iterdir():
        f.chmod(0o644)  # safetensors writes 0600; a shared cache must be readable
    return meta


def tiny_start_dir(cache_dir: str | Path | None = None, *, seed: int = 0, sft: TinySFTConfig | None = None) -> Path:
    """Where :func:`tiny_start_checkpoint` keeps the start: ``<cache>/tiny-adder-v1-seed{seed}[-<cfg hash>]``."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    name = f"{TINY_KIND}-v{TINY_VERSION}-seed{seed}"
    if sft is not None and sft != TinySFTConfig():
        import hashlib

        name += "-" + hashlib.sha256(json.dumps(asdict(sft), sort_keys=True).encode()).hexdigest()[:10]
    return root / name


def _is_complete(path: Path, seed: int, sft: TinySFTConfig) -> bool:
    if not all((path / f).is_file() for f in _REQUIRED_FILES):
        return False
    try:
        meta = json.loads((path / META_NAME).read_text())
    except ValueError:
        return False
    return (meta.get("kind"), meta.get("version"), meta.get("seed"), meta.get("sft")) == (
        TINY_KIND, TINY_VERSION, seed, json.loads(json.dumps(asdict(sft))))


def _remove_stale_builds(final: Path, max_age_s: float = 3600.0) -> None:
    """Delete temporary build dirs of ``final`` left by killed builds (older than any real build)."""
    now = time.time()
    for stale in final.parent.glob(f".{final.name}.*-*"):
        try:
            if stale.is_dir() and now - stale.stat().st_mtime > max_age_s:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            pass


def tiny_start_checkpoint(cache_dir: str | Path | None = None, *, seed: int = 0, force: bool = False,
                          sft: TinySFTConfig | None = None) -> Path:
    """The HF-format checkpoint dir of the SFT'd tiny start: the shipped copy (:data:`SHIPPED_DIR`) for seed 0 and the
    default SFT config, else a build made on first use and cached.

    ``cache_dir`` is the cache root (default ``$JETRL_CACHE`` or ``~/.cache/jetrl``); the checkpoint
    is ``tiny_start_dir(cache_dir, seed=seed, sft=sft)``. A complete cached build (all files, same
    version, seed and SFT config) is reused unless ``force``. A build is written into a temporary
    sibling directory and moved into place with ``os.replace``, so a killed build never leaves a
    half-written cache, and two concurrent builds leave one complete copy.
    """
    cfg = sft or TinySFTConfig()
    if not force and _is_complete(SHIPPED_DIR, seed, cfg):
        return SHIPPED_DIR
    final = tiny_start_dir(cache_dir, seed=seed, sft=sft)
    if not force and _is_complete(final, seed, cfg):
        return final
    problem = unwritable(final.parent)
    if problem:
        raise OSError(f"the tiny start's cache {final.parent} cannot be written ({problem}): point JETRL_CACHE at a "
                      "writable directory (unset, it is ~/.cache/jetrl)")
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_builds(final)
    print(f"jetrl: building the tiny start policy (SFT on synthetic addition, seed {seed}; ~2-3 min on 2 CPU "
          f"cores) into {final} ...", end=" ", flush=True)
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
    try:
        try:
            meta = train_tiny_start(tmp, seed=seed, sft=cfg)
        except BaseException:
            print("failed", flush=True)
            raise
        if final.exists() and (force or not _is_complete(final, seed, cfg)):
            trash = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
            os.replace(final, trash / "old")
            shutil.rmtree(trash, ignore_errors=True)
        try:
            os.replace(tmp, final)
        except OSError:
            if not _is_complete(final, seed, cfg):  # lost a race to a concurrent build: use its copy
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"done in {time.perf_counter() - t0:.0f}s (held-out greedy accuracy {meta['greedy']['accuracy']:.0%}, "
          f"sampled {meta['sampled']['accuracy']:.0%})", flush=True)
    return final
