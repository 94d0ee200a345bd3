"""Section (d), one row: the per-step sampler, its fused kernel against the PyTorch spec.

What is measured: one decode step's draw of ``decode_batch`` tokens from (B, vocab) bf16 logits at
temperature 1 -- :func:`~jetrl.engine.sampling.sample_reference` (the spec: fp32 log_softmax, exp,
cumsum, two searchsorted) against :func:`~jetrl.engine.kernels.sample_triton.sample_triton` (two
streaming passes over the logits in their own dtype) -- under CUDA-graph replay. Sampling runs
outside the engine's decode graph, once per step, for every recipe alike.

Check: same uniforms, so the same tokens except where a draw lies within fp32 rounding of a cdf
boundary (the spec's own tokens differ between CPU and GPU there): at most ``MAX_FLIPS`` of the
draws may differ, and the logprobs of the agreeing draws within ``LOGPROB_ATOL``.
"""

from __future__ import annotations

from typing import Any

import torch

from jetrl.bench.checks import status
from jetrl.bench.shapes import BenchConfig
from jetrl.bench.timing import graph_time_us
from jetrl.engine.sampling import SamplingParams, sample_reference

MAX_FLIPS, LOGPROB_ATOL = 0.03, 1e-4


def sampler_row(cfg: BenchConfig, device: torch.device) -> dict[str, Any]:
    from jetrl.engine.kernels.sample_triton import sample_triton

    gen = torch.Generator(device="cpu").manual_seed(0)
    B, V = cfg.decode_batch, cfg.vocab
    logits = (torch.randn(B, V, generator=gen) * 3).to(device, torch.bfloat16)
    keys, steps = torch.arange(B, device=device) * 7919, torch.full((B,), 5, device=device)
    params = SamplingParams(temperature=1.0)
    ref_tok, ref_lp = sample_reference(logits, params, keys, steps)
    tok, lp = sample_triton(logits, params, keys, steps)
    same = tok == ref_tok
    flips = 1 - float(same.float().mean())
    lp_err = float((lp - ref_lp)[same].abs().max()) if bool(same.any()) else float("inf")
    graph = dict(calls=cfg.graph_calls, replays=cfg.graph_replays)
    spec_us = graph_time_us(lambda: sample_reference(logits, params, keys, steps), device, **graph)
    kernel_us = graph_time_us(lambda: sample_triton(logits, params, keys, steps), device, **graph)
    ok = flips <= MAX_FLIPS and lp_err <= LOGPROB_ATOL
    return {"name": f"sampling one step B={B} V={V} (bf16 logits, T=1)", "unit": "us", "baseline": spec_us,
            "baseline_label": "PyTorch spec", "value": kernel_us, "value_label": "fused kernel",
            "ratio": spec_us / kernel_us, "check": status(ok),
            "check_detail": f"{flips:.2%} of tokens differ (<= {MAX_FLIPS:.0%}: cdf-boundary draws), "
                            f"logprob max err {lp_err:.1e}"}
