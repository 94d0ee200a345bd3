"""The engine's host sync per decode window, three ways, in a full rollout on the GPU: 8B-shaped random Qwen3
(36 layers), 256 prompts of 128 tokens, 512 new tokens, ``bf16`` and ``jet_kv``, each way twice in turn:

* ``serial, per token``: sync after each window, tokens appended one ``Scheduler.append`` at a time (before);
* ``serial, bulk``: one ``Scheduler.extend`` per sequence and window (``Engine(overlap_sync=False)``);
* ``overlapped``: the next window is launched before the last one is synced (the default).

Reports ms per decode step (prefill excluded, as bench (e)) and, for the serial ways, the host's wall time
inside ``_sync`` per window, timed after the window finished on the GPU: the time the GPU has nothing
queued. GPU only; writes $OUT/time_rollout_sync.json.

    PYTHONPATH=. OUT=/tmp python3 bench/time_rollout_sync.py
"""

import contextlib
import json
import os
import statistics
import time
from unittest import mock

import torch

from jetrl.bench.models import free_device_memory, random_model
from jetrl.bench.rollout import engine_rollout
from jetrl.bench.shapes import h200_config
from jetrl.bench.synthetic import random_prompts
from jetrl.engine import Engine
from jetrl.engine.scheduler import Scheduler

DEV = torch.device("cuda")


def _per_token(self, seq, tokens, logprobs, check):
    for token, logprob in zip(tokens, logprobs):
        if self.append(seq, token, logprob, check):
            break
    return seq.is_finished


def main() -> None:
    cfg = h200_config()
    model = random_model(cfg.model_config(cfg.layers), DEV, torch.bfloat16).requires_grad_(False)
    prompts = random_prompts(256, 128, cfg.vocab, seed=0)
    results = []
    original_sync, original_init = Engine._sync, Engine.__init__
    for recipe in ("bf16", "jet_kv"):
        for variant in ("serial, per token", "serial, bulk", "overlapped") * 2:
            host = []
            overlap = variant == "overlapped"

            def init(self, *args, **kwargs):
                original_init(self, *args, **{**kwargs, "overlap_sync": overlap})

            def timed_sync(self, *args, **kwargs):
                torch.cuda.synchronize()  # serial: the host would wait for the window in its copy anyway
                t0 = time.perf_counter()
                try:
                    return original_sync(self, *args, **kwargs)
                finally:
                    host.append(time.perf_counter() - t0)

            patches = [mock.patch.object(Engine, "__init__", init)]
            if not overlap:
                patches.append(mock.patch.object(Engine, "_sync", timed_sync))
            if variant == "serial, per token":
                patches.append(mock.patch.object(Scheduler, "extend", _per_token))
            with contextlib.ExitStack() as stack:
                for patch in patches:
                    stack.enter_context(patch)
                r = engine_rollout(model, recipe, prompts, 512, DEV)
            row = {"recipe": recipe, "variant": variant, "ms_per_step": r["ms_per_step"], "tok_s": r["tok_s"],
                   "syncs": len(host), "sync_ms_median": statistics.median(host) * 1e3 if host else None}
            results.append(row)
            sync = f", {len(host)} syncs, median _sync {row['sync_ms_median']:.2f} ms" if host else ""
            print(f"{recipe:7s} {variant:18s}: {r['ms_per_step']:.3f} ms/step, {r['tok_s']:,.0f} tok/s{sync}",
                  flush=True)
            free_device_memory()
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "time_rollout_sync.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
