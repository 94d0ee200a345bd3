"""The post-MLP residual add done by the next norm (``DecoderLayer.forward`` returns ``(h, mlp_out)`` unadded, and
the next input norm or the final norm adds them in its kernel) against the separate add, on and off in one process,
on the H200.

The engine's decode step (8B-shaped random Qwen3, 36 layers, mean context 640) for ``bf16``, ``jet`` and ``jet_kv``
at B = 64 (the RL step's rollout) and 256 (bench (d)). The "off" arm captures its CUDA graph with the layer forward
of before (the add as its own kernel, then the next layer's plain RMSNorm); the "on" arm is the library's code. Each
configuration is timed off, on, on, off (the mean of each pair kept; bench/probe_pdl_prefetch.py says why), and the
two arms' logits are compared (the sum is the same bf16 rounding; the norm of it runs in the fused add + norm kernel
instead of the plain norm kernel, whose row sums may be ordered differently). GPU only; writes
$OUT/probe_residual_fusion.json.

    PYTHONPATH=. OUT=$OUT python3 bench/probe_residual_fusion.py
"""

import contextlib
import json
import os

import torch

from jetrl.bench.models import random_model
from jetrl.bench.rollout import ab_decode_steps
from jetrl.bench.shapes import h200_config
from jetrl.models.llama import DecoderLayer

DEV = torch.device("cuda")


def _separate_add(self, x, cos, sin, mask, kv_cache=None, delta=None):
    """The layer forward before the change: the residual add after the MLP as its own op (``delta`` stays None)."""
    x, normed = self.post_attention_layernorm.add_forward(x, self.self_attn(self.input_layernorm(x), cos, sin, mask,
                                                                                kv_cache))
    return x + self.mlp(normed), None


@contextlib.contextmanager
def fused(on: bool):
    shipped = DecoderLayer.forward
    if not on:
        DecoderLayer.forward = _separate_add
    try:
        yield
    finally:
        DecoderLayer.forward = shipped


def main() -> None:
    cfg = h200_config()
    results: list[dict] = []
    model = random_model(cfg.model_config(cfg.layers), DEV, torch.bfloat16).requires_grad_(False)
    batches = [int(b) for b in os.environ.get("STEP_BATCHES", "64,256").split(",")]
    try:
        for r in ab_decode_steps(model, cfg, fused, batches, DEV):
            logits, recipe, batch, off, on = r.pop("logits"), r["recipe"], r["batch"], r["off_ms"], r["on_ms"]
            diff = float((logits[True] - logits[False]).abs().max())
            results.append({**r, "logits_max_abs_diff": diff, "finite": bool(torch.isfinite(logits[True]).all())})
            print(f"decode step {recipe:7s} B={batch:3d}: separate add {off:.3f} ms, in the next norm {on:.3f} ms "
                  f"({off / on:.4f}x, {(off - on) / cfg.layers * 1e3:.2f} us per layer); logits max |diff| "
                  f"{diff:.3g}", flush=True)
    finally:
        with open(os.path.join(os.environ.get("OUT", "/tmp"), "probe_residual_fusion.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
