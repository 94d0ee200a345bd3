"""Which op made GPU training runs non-reproducible? (the answer is in jetrl/run/determinism.py)

Four runs of `jetrl train` on an H200, then without deterministic mode, parted ways at step 2-19; with torch's
deterministic algorithms they matched bit for bit (docs/benchmarks.md, runs FM-FQ), and no op warned, so torch
switched some op to a deterministic kernel silently. This probe finds it. It builds the embedded default's trainer
on CUDA (its model, task, recipe and training CUDA graphs), draws one rollout batch, gives it fixed random advantages
(so every gradient is non-zero), and under each MODE repeats, REPS times from the same weights:

    rollout  the same rollout, same seed: do the tokens and logprobs repeat?
    forward  the trainer's old-logprob pass (no grad): do the logprobs repeat?
    grads    the trainer's loss backward: which parameters' gradients differ between repetitions? Nondeterminism
             flows backward, so the parameter nearest the loss that differs is where it starts.

Modes: ``default``; ``deterministic`` (jetrl/run/determinism.py); ``default`` with scaled_dot_product_attention held to
one backend (``sdpa=flash|efficient|cudnn|math``); ``eager`` (the training graphs off). The training graphs are
captured again for every mode. cuBLAS has the fixed workspace throughout (set before the process starts, below):
it alone did not make runs repeat (run FP).

    CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONPATH=. OUT=$OUT python3 bench/probe_nondeterminism.py

``DTYPE=bfloat16`` trains the model in BF16, as a real one is (the default's is fp32); ``DEVICE=cpu REPS=2
MODES=default,eager`` checks the probe itself on a CPU, where every mode repeats.

Found (runs FR, FS; docs/benchmarks.md "Reproducibility on the GPU"): in fp32, only the token embedding's gradient
varied, in ``default`` and ``sdpa=math`` (the only backend that runs this fp32 model), never ``eager`` or
``deterministic``; in BF16 nothing varied in any mode.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jetrl.rl.batch import completion_logprobs  # noqa: E402
from jetrl.rl.loss import policy_loss  # noqa: E402
from jetrl.rl.rollout import rollout  # noqa: E402
from jetrl.rl.trainer import GRPOTrainer  # noqa: E402
from jetrl.run.determinism import deterministic_algorithms  # noqa: E402
from jetrl.run.models import load_model  # noqa: E402
from jetrl.run.presets import get_preset  # noqa: E402
from jetrl.run.tasks import load_task  # noqa: E402

REPS = int(os.environ.get("REPS", "4"))
MODES = os.environ.get("MODES", "default,deterministic,sdpa=flash,sdpa=efficient,sdpa=cudnn,sdpa=math,eager").split(",")


def build() -> GRPOTrainer:
    cfg = get_preset("default")
    cfg.model.dtype = os.environ.get("DTYPE", cfg.model.dtype)  # float32 as shipped; bfloat16 as a real model trains
    torch.manual_seed(cfg.grpo.seed)
    records, _ = load_task(cfg.task)
    device = os.environ.get("DEVICE", "cuda")
    model, tokenizer, _ = load_model(cfg.model.name, cfg.model.dtype, recipe=cfg.recipe, device=device)
    trainer = GRPOTrainer(model, cfg.task.reward_funcs, cfg.grpo, records, tokenizer=tokenizer, recipe=cfg.recipe,
                          system_prompt=cfg.task.system_prompt)
    for _ in range(3):  # away from the initial weights, as a run is by step 2
        trainer.train_step()
    return trainer


def draw(trainer: GRPOTrainer, seed: int):
    idx = trainer.prompt_indices(trainer.step)
    batch, _, _ = rollout(trainer.engine, [trainer.prompt_ids[i] for i in idx], [trainer.records[i] for i in idx],
                          trainer.reward_funcs, trainer.args, seed=seed, accuracy_func=trainer.accuracy_func)
    return batch


def grads(trainer: GRPOTrainer, batch) -> dict[str, torch.Tensor]:
    model = trainer.model
    lp, _ = completion_logprobs(model, batch, with_entropy=True, hidden_states=trainer.graphed_hidden_states())
    mask = batch.completion_mask.to(lp.device)
    loss, _ = policy_loss(lp, lp.detach(), batch.advantages.to(lp.device), mask, epsilon_low=0.2, epsilon_high=0.28,
                          loss_type="dapo", num_items_in_batch=float(mask.sum()))
    loss.backward()
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def mode_context(mode: str):
    if mode == "deterministic":
        return deterministic_algorithms()
    if mode.startswith("sdpa="):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                   "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[mode.split("=")[1]]
        return sdpa_kernel([backend])
    return contextlib.nullcontext()


def layer_of(name: str) -> int:
    found = re.search(r"layers\.(\d+)\.", name)
    return int(found.group(1)) if found else (10**6 if "norm" in name or "lm_head" in name else -1)


def run_mode(trainer: GRPOTrainer, batch, mode: str) -> dict:
    graphs = trainer.train_graphs
    if graphs is not None:
        graphs.reset()
    if mode == "eager":
        trainer.train_graphs = None
    try:
        with mode_context(mode):
            draws = [draw(trainer, seed=12345) for _ in range(REPS)]
            with torch.no_grad():
                fwd = [completion_logprobs(trainer.model, batch, hidden_states=trainer.graphed_hidden_states())[0]
                       for _ in range(REPS)]
            gs = [grads(trainer, batch) for _ in range(REPS)]
    except Exception as error:  # noqa: BLE001 -- a backend that cannot run this model: say so, go on
        return {"error": f"{type(error).__name__}: {str(error)[:300]}"}
    finally:
        trainer.train_graphs = graphs
    same_rollout = all(torch.equal(d.completion_ids, draws[0].completion_ids)
                       and torch.equal(d.rollout_logprobs, draws[0].rollout_logprobs) for d in draws)
    differ = sorted({n for g in gs[1:] for n in g if not torch.equal(g[n], gs[0][n])}, key=layer_of)
    return {"rollout_repeats": same_rollout, "forward_repeats": all(torch.equal(f, fwd[0]) for f in fwd),
            "grads_differ": len(differ), "grads": len(gs[0]), "nearest_the_loss": differ[-3:],
            "max_abs_grad_diff": max((float((g[n] - gs[0][n]).abs().max()) for g in gs[1:] for n in differ),
                                     default=0.0)}


def main() -> None:
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") is None:
        raise SystemExit("set CUBLAS_WORKSPACE_CONFIG=:4096:8 before the process starts (the module docstring)")
    trainer = build()
    batch = draw(trainer, seed=777)
    gen = torch.Generator().manual_seed(0)
    batch.advantages = torch.randn(batch.advantages.shape, generator=gen)
    report = {"sdpa_default_backends": {k: getattr(torch.backends.cuda, f"{k}_sdp_enabled")()
                                        for k in ("flash", "mem_efficient", "cudnn", "math")},
              "train_graphs": trainer.train_graphs is not None, "rows": len(batch)}
    for mode in MODES:
        report[mode] = run_mode(trainer, batch, mode)
        print(mode, json.dumps(report[mode]), flush=True)
    out = Path(os.environ.get("OUT", "."))
    (out / "nondeterminism.json").write_text(json.dumps(report, indent=1))
    print(f"\n{'mode':<16} {'rollout':>8} {'forward':>8} {'grads differ':>13}  nearest the loss")
    for mode in MODES:
        r = report[mode]
        if "error" in r:
            print(f"{mode:<16} {r['error'][:90]}")
        else:
            print(f"{mode:<16} {r['rollout_repeats']!s:>8} {r['forward_repeats']!s:>8} "
                  f"{r['grads_differ']:>6}/{r['grads']:<6}  {', '.join(r['nearest_the_loss'])}")


if __name__ == "__main__":
    main()
