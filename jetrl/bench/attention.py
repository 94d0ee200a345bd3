"""Section (d), first rows: the decode-attention kernel's effective TB/s, BF16 and FP8 cache.

What is measured: one decode step's attention for one layer -- ``decode_attention`` over a
static cache of ``decode_batch`` rows whose lengths spread around ``decode_context`` -- under
CUDA-graph replay. Effective TB/s counts the bytes a row *must* read: its valid K and V
positions (and, for FP8, their per-token-head scales). The baseline is SDPA over the same
BF16 cache with a mask, which is what the engine ran before this kernel: it reads every
position of the fixed-length rows, valid or not. A third row runs the BF16 cache at half the
context, i.e. the FP8 cache's bytes with BF16 arithmetic: the gap between it and the FP8 rows is
the cost of the FP8 operands, not of HBM. The FP8 cache is timed with fp32 scales (dequantized in
the loop) and with power-of-two scales (``jet_kv``'s, kept out of the dots). Correctness: the
kernel's output against :func:`~jetrl.engine.decode_attention.decode_attention_reference`
(relative error). Every kernel row takes the rows longest first, as the engine does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from jetrl.bench.checks import rel_err, status
from jetrl.bench.shapes import BenchConfig
from jetrl.bench.timing import graph_time_us, tb_per_s
from jetrl.engine.decode_attention import decode_attention, decode_attention_reference, longest_first
from jetrl.fp8.quant import E4M3

ATTN_REL_ERR_MAX = 1e-2  # bf16 outputs of a softmax-weighted mean: a few bf16 ulps


def decode_attention_rows(cfg: BenchConfig, device: torch.device, lengths: list[int]) -> list[dict[str, Any]]:
    B, H, Hkv, D = len(lengths), cfg.heads, cfg.kv_heads, cfg.head_dim
    S = max(lengths) + 2
    gen = torch.Generator(device="cpu").manual_seed(0)
    lengths_t = torch.tensor(lengths, device=device)
    q = torch.randn(B, H, D, generator=gen).to(device, torch.bfloat16)
    k = torch.randn(B, Hkv, S, D, generator=gen).to(device, torch.bfloat16)
    v = torch.randn(B, Hkv, S, D, generator=gen).to(device, torch.bfloat16)
    mask = (torch.arange(S, device=device)[None, :] <= lengths_t[:, None])[:, None, None, :]
    q_folded = q.view(B, Hkv, H // Hkv, D)  # the engine's GQA decode fold (models/llama.py)
    sdpa_us = graph_time_us(lambda: F.scaled_dot_product_attention(q_folded, k, v, attn_mask=mask), device,
                            calls=cfg.graph_calls, replays=cfg.graph_replays)
    rows = []
    # FP8 caches: random per-token-head scales, fp32 (the quantizer's default rule) or powers of two
    # (jet_kv's KV spec, which the kernel keeps out of its dots)
    k_scales = (0.1 + 0.05 * torch.rand(B, Hkv, S, generator=gen)).to(device)
    v_scales = (0.1 + 0.05 * torch.rand(B, Hkv, S, generator=gen)).to(device)
    k_pow2, v_pow2 = (torch.exp2(torch.ceil(torch.log2(s))) for s in (k_scales, v_scales))
    fp8 = {"k": (k / k_scales[..., None]).to(E4M3), "v": (v / v_scales[..., None]).to(E4M3),
           "kw": {"k_scales": k_scales, "v_scales": v_scales}}
    fp8_pow2 = {"k": (k / k_pow2[..., None]).to(E4M3), "v": (v / v_pow2[..., None]).to(E4M3),
                "kw": {"k_scales": k_pow2, "v_scales": v_pow2, "pow2_scales": True}}
    half = lengths_t // 2  # the FP8 cache's bytes, read with BF16 arithmetic
    variants = [("bf16 cache", k, v, {}, lengths_t, 2),
                ("bf16 cache, half context", k, v, {}, half, 2),
                ("fp8 cache, fp32 scales", fp8["k"], fp8["v"], fp8["kw"], lengths_t, 1),
                ("fp8 cache, pow2 scales (jet_kv)", fp8_pow2["k"], fp8_pow2["v"], fp8_pow2["kw"], lengths_t, 1)]
    for label, kk, vv, kw, lens, elem in variants:
        kw = {**kw, "row_order": longest_first(lens)}  # the program order the engine passes (once per step)
        out = decode_attention(q, kk, vv, lens, **kw)
        ref_kw = {key: val for key, val in kw.items() if key not in ("pow2_scales", "row_order")}  # same math
        err = rel_err(out, decode_attention_reference(q, kk, vv, lens, **ref_kw))
        us = graph_time_us(lambda kk=kk, vv=vv, kw=kw, lens=lens: decode_attention(q, kk, vv, lens, **kw), device,
                           calls=cfg.graph_calls, replays=cfg.graph_replays)
        n_valid = int((lens + 1).sum())
        nbytes = 2 * n_valid * Hkv * D * elem + (2 * n_valid * Hkv * 4 if elem == 1 else 0)
        rows.append({
            "name": f"decode attention {label} B={B} ctx {cfg.decode_context}", "unit": "us",
            "baseline": sdpa_us, "baseline_label": "SDPA full", "value": us, "value_label": "kernel",
            "ratio": sdpa_us / us, "tb_s": tb_per_s(nbytes, us * 1e-3), "rel_err": err,
            "check": status(err < ATTN_REL_ERR_MAX), "check_detail": f"rel err {err:.1e}",
            "note": f"{tb_per_s(nbytes, us * 1e-3):.2f} TB/s of valid K/V; ratio = speedup over SDPA on the full cache",
        })
    return rows
