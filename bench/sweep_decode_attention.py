"""The H200 sweep behind the decode-attention defaults (DEFAULT_TILES: block, warps, stages; and
splits), for a BF16 cache and FP8 caches with fp32 scales (dequantized in the loop) or power-of-two
scales (kept outside the dots), against SDPA over the full static cache; plus the BF16 cache at half
the length (the FP8 cache's bytes with BF16 arithmetic: what an FP8 loop would take if only bytes
counted).
GPU only; writes $OUT/attn.json.

    PYTHONPATH=. OUT=/tmp python3 bench/sweep_decode_attention.py
"""

import itertools
import json
import os
import time

import torch
import torch.nn.functional as F

from jetrl.bench.timing import graph_time_us
from jetrl.engine.decode_attention import decode_attention_reference, longest_first
from jetrl.engine.kernels.decode_attention_triton import decode_attention_triton


def main() -> None:
    DEV = torch.device("cuda")
    OUT = os.environ.get("OUT", "/tmp")
    res = []
    t0 = time.time()
    for B, S, lo, hi in [(256, 1152, 128, 1152), (64, 4096, 3072, 4096)]:
        H, Hkv, D = 32, 8, 128
        g = torch.Generator(device="cpu").manual_seed(0)
        lengths = torch.randint(lo, hi, (B,), generator=g).to(DEV)
        valid = int((lengths + 1).sum())
        q = torch.randn(B, H, D, device=DEV, dtype=torch.bfloat16)
        kb = torch.randn(2, B, Hkv, S, D, device=DEV, dtype=torch.bfloat16)
        vb = torch.randn(2, B, Hkv, S, D, device=DEV, dtype=torch.bfloat16)
        k8 = (kb * 4).to(torch.float8_e4m3fn)
        v8 = (vb * 4).to(torch.float8_e4m3fn)
        ks = torch.rand(2, B, Hkv, S, device=DEV) * 0.25 + 0.01
        vs = torch.rand(2, B, Hkv, S, device=DEV) * 0.25 + 0.01
        ks2, vs2 = torch.exp2(torch.ceil(torch.log2(ks))), torch.exp2(torch.ceil(torch.log2(vs)))  # pow2 scales
        mask = (torch.arange(S, device=DEV)[None, :] <= lengths[:, None])[:, None, None, :]
        qs = q.view(B, Hkv, H // Hkv, D)
        sdpa_us = graph_time_us(
            lambda: F.scaled_dot_product_attention(qs, kb[1], vb[1], attn_mask=mask), DEV, calls=5, replays=5
        )
        base = {"B": B, "S": S, "avg_ctx": valid / B}
        res.append(
            {**base, "kind": "sdpa_full_bf16", "us": sdpa_us, "valid_tb_s": valid * Hkv * D * 2 * 2 / sdpa_us / 1e6}
        )
        print(res[-1], flush=True)
        for kind in ("bf16", "bf16 half length", "fp8", "fp8 pow2"):
            fp8, pow2 = kind.startswith("fp8"), kind == "fp8 pow2"
            kk, vv = (k8[1], v8[1]) if fp8 else (kb[1], vb[1])
            lens = lengths // 2 if kind == "bf16 half length" else lengths
            order = longest_first(lens)  # as the engine passes it
            kw = {"k_scales": ks2[1] if pow2 else ks[1], "v_scales": vs2[1] if pow2 else vs[1]} if fp8 else {}
            ref = decode_attention_reference(q, kk, vv, lens, **kw).float()
            n_valid = int((lens + 1).sum())
            nbytes = n_valid * Hkv * D * (1 if fp8 else 2) * 2 + (n_valid * Hkv * 4 * 2 if fp8 else 0)
            best = None
            tiles = [(16, 1, 3), (32, 1, 2), (32, 1, 3), (32, 1, 4), (64, 1, 3), (32, 2, 3), (64, 2, 3), (64, 4, 3)]
            grid = [(bs, nw, st, sp) for (bs, nw, st), sp in itertools.product(tiles, (None, 1, 2, 4))]
            if kind == "bf16 half length":
                grid = [(None, None, None, None)]
            for bs, nw, st, sp in grid:
                try:
                    fn = lambda: decode_attention_triton(
                        q, kk, vv, lens, block_s=bs, num_warps=nw, num_stages=st, num_splits=sp, pow2_scales=pow2,
                        row_order=order, **kw
                    )
                    err = float((fn().float() - ref).abs().max())
                    us = graph_time_us(fn, DEV, calls=5, replays=5)
                except Exception as e:
                    print("fail", kind, bs, nw, st, sp, repr(e)[:300])
                    continue
                row = {**base, "kind": kind, "block_s": bs, "warps": nw, "stages": st, "splits": sp, "us": us,
                       "tb_s": nbytes / us / 1e6, "err": err}
                res.append(row)
                if best is None or us < best["us"]:
                    best = row
            print("best", best, flush=True)
    print("time", time.time() - t0)
    json.dump(res, open(f"{OUT}/attn.json", "w"), indent=1)


if __name__ == "__main__":
    main()
