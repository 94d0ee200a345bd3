"""Decode attention against the number of splits at the RL step's batch (B = 64, rows of near-equal
length: one prompt length, every row at the same decode step) and at (e)'s B = 256; then o_proj's FP8
input written in the kernels' epilogue against a separate quantize, per merge width. GPU only; writes
$OUT/attn_splits.json (``SWEEP_SPLITS=0``: the epilogue rows only).

    PYTHONPATH=. OUT=/tmp python3 bench/sweep_attention_splits.py
"""

import itertools
import json
import os

import torch

from jetrl.bench.timing import graph_time_us
from jetrl.engine.decode_attention import decode_attention_reference, longest_first
from jetrl.engine.kernels.decode_attention_triton import choose_num_splits, decode_attention_triton


H, Hkv, D, S = 32, 8, 128, 1152  # Qwen3-8B's attention; the cache's static length


def make_case(dev: torch.device, B: int, lo: int, hi: int, seed: int) -> tuple:
    """Lengths in [lo, hi), q, a BF16 cache, its FP8 codes with power-of-two scales, and the row order."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    lengths = torch.randint(lo, hi, (B,), generator=g).to(dev)
    q = torch.randn(B, H, D, device=dev, dtype=torch.bfloat16)
    kb = torch.randn(B, Hkv, S, D, device=dev, dtype=torch.bfloat16)
    vb = torch.randn(B, Hkv, S, D, device=dev, dtype=torch.bfloat16)
    k8, v8 = (kb * 4).to(torch.float8_e4m3fn), (vb * 4).to(torch.float8_e4m3fn)
    ks = torch.exp2(torch.randint(-6, -2, (B, Hkv, S), device=dev).float())
    vs = torch.exp2(torch.randint(-6, -2, (B, Hkv, S), device=dev).float())
    return lengths, q, kb, vb, k8, v8, ks, vs, longest_first(lengths)


def main() -> None:
    dev = torch.device("cuda")
    res = []
    cases = [(64, 224, 288), (64, 608, 672), (64, 1088, 1151), (256, 128, 1151), (32, 608, 672)]
    for B, lo, hi in cases if os.environ.get("SWEEP_SPLITS", "1") == "1" else []:
        lengths, q, kb, vb, k8, v8, ks, vs, order = make_case(dev, B, lo, hi, seed=0)
        n_valid = int((lengths + 1).sum())
        default = choose_num_splits(B, Hkv, S, 32, torch.cuda.get_device_properties(dev).multi_processor_count)
        for kind in ("bf16", "fp8 pow2"):
            fp8 = kind != "bf16"
            kk, vv = (k8, v8) if fp8 else (kb, vb)
            kw = {"k_scales": ks, "v_scales": vs, "pow2_scales": True} if fp8 else {}
            ref = decode_attention_reference(q, kk, vv, lengths, **{k: v for k, v in kw.items() if k != "pow2_scales"})
            nbytes = n_valid * Hkv * D * (1 if fp8 else 2) * 2 + (n_valid * Hkv * 8 if fp8 else 0)
            for splits in (1, 2, 3, 4, 6, 8, 12, 16):
                for warps in (1, 2):
                    fn = lambda: decode_attention_triton(q, kk, vv, lengths, row_order=order, num_splits=splits,
                                                         num_warps=warps, **kw)
                    err = float((fn().float() - ref.float()).abs().max())
                    us = graph_time_us(fn, dev, calls=10, replays=10)
                    row = {"B": B, "ctx": n_valid / B, "kind": kind, "splits": splits, "warps": warps,
                           "default": splits == default and warps == 1, "us": us, "tb_s": nbytes / us / 1e6,
                           "err": err}
                    res.append(row)
            best = min((r for r in res if r["B"] == B and r["kind"] == kind and abs(r["ctx"] - n_valid / B) < 1e-9),
                       key=lambda r: r["us"])
            dflt = [r for r in res if r["B"] == B and r["kind"] == kind and r["default"]
                    and abs(r["ctx"] - n_valid / B) < 1e-9]
            print(f"B={B} ctx={n_valid / B:.0f} {kind}: default ({default} splits) {dflt[0]['us']:.1f} us; "
                  f"best {best['splits']} splits {best['warps']} warps {best['us']:.1f} us ({best['tb_s']:.2f} TB/s) "
                  f"err {best['err']:.2e}", flush=True)
    res += epilogue_rows(dev)
    json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "attn_splits.json"), "w"), indent=1)


def epilogue_rows(dev: torch.device) -> list[dict]:
    """o_proj's FP8 input written by the attention kernel (1 split) or the merge (2): µs with and without it,
    and the merge's warps, at the default split count; the codes checked against quantize()."""
    from jetrl.fp8.quant import quantize
    from jetrl.models.fused import QuantizedOutput

    rows = []
    for B, lo, hi in [(64, 608, 672), (64, 224, 288), (256, 128, 1151)]:
        lengths, q, kb, vb, k8, v8, ks, vs, order = make_case(dev, B, lo, hi, seed=1)
        codes = torch.empty(B, H * D, device=dev, dtype=torch.float8_e4m3fn)
        scales = torch.empty(H, B, device=dev).t()
        quant = QuantizedOutput(codes, scales, True)
        caches = {"fp8 pow2": (k8, v8, {"k_scales": ks, "v_scales": vs, "pow2_scales": True}), "bf16": (kb, vb, {})}
        for (kind, (kk, vv, kw)), merge_warps in itertools.product(caches.items(), (1, 4)):
            for with_quant in (False, True):
                fn = lambda: decode_attention_triton(q, kk, vv, lengths, row_order=order, merge_warps=merge_warps,
                                                     quantized=quant if with_quant else None, **kw)
                out = fn()
                ok = None
                if with_quant:
                    ref = quantize(out.reshape(B, -1), (1, 128), pow2_scale=True)
                    ok = bool(torch.equal(ref.codes.view(torch.uint8), codes.view(torch.uint8))
                              and torch.equal(ref.scales, scales))
                us = graph_time_us(fn, dev, calls=10, replays=10)
                quant_us = graph_time_us(lambda: quantize(out.reshape(B, -1), (1, 128), pow2_scale=True,
                                                          col_major_scales=True), dev, calls=10, replays=10)
                rows.append({"section": "epilogue", "kind": kind, "B": B, "ctx": float((lengths + 1).float().mean()),
                             "merge_warps": merge_warps, "quant_in_epilogue": with_quant, "us": us,
                             "separate_quantize_us": quant_us, "codes_equal": ok})
                print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":
    main()
