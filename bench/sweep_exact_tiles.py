"""Exact mode's tile shapes on the H200: each candidate's batch invariance and speed, against the shipped one.

Exact mode (jetrl/exact.py) runs one tile shape per kernel for every problem size; the shipped shapes
(exact_linear_triton.TILES, gemm_exact_triton.TILES, exact_attention_triton.TILES) are part of the arithmetic. A
candidate qualifies only if a row's bits do not depend on M (rows of 1, 7, 64 and 256-row calls equal the same rows
of a 9216-row call; a GEMM's K runs as separate programs equal them in one program; attention: a decode step over a
cache equals the causal forward's row), and it reports whether its bits equal the shipped tiles' (where they do, the
tile could be chosen per shape, as exact mode does with the Gluon FP8 GEMM). For each it then times Qwen3-8B's shapes
at the trainer's M (8 x 1152 tokens, CUDA events, median) and a layer's four GEMMs at decode sizes (M = 64, 256) under
CUDA-graph replay. The FP8 section sweeps the Triton exact kernel, which exact mode runs only where the Gluon kernel
cannot take a layer (jetrl/fp8/gemm.py ``_gemm_exact``).

    PYTHONPATH=. OUT=$OUT python3 bench/sweep_exact_tiles.py
"""

import json
import os
from functools import partial

import torch

from jetrl.bench.shapes import h200_config
from jetrl.bench.timing import graph_time_us, time_ms
from jetrl.exact import use_exact
from jetrl.fp8.kernels import gemm_exact_triton
from jetrl.fp8.kernels.split_k import k_splits
from jetrl.fp8.kv_quant import quantize_kv
from jetrl.fp8.quant import quantize
from jetrl.models.exact_ops import exact_cache_attention
from jetrl.models.kernels import exact_attention_triton, exact_linear_triton

DEV, BF = torch.device("cuda"), torch.bfloat16
BIG, SMALL = 9216, (1, 7, 64, 256)
LAYER = {name: (n, k) for name, k, n in h200_config().layer_gemms()}  # an 8B layer: name -> (N, K)
# (BLOCK_M, BLOCK_N, BLOCK_K, SPLITS, num_warps, num_stages); the first is the shipped one. SPLITS = 1 is the kernel
# before run CU (no K runs; 128 x 128 / 4 warps spills once it keeps a second accumulator)
LINEAR = [(128, 128, 64, 4, 8, 4), (128, 128, 64, 4, 8, 3), (64, 128, 64, 4, 4, 3), (128, 128, 64, 1, 4, 3)]
# (BLOCK_M, BLOCK_N, SPLITS, num_warps, num_stages); the first is the shipped one, the last the kernel before run CU
FP8 = [(64, 128, 4, 4, 3), (64, 128, 4, 8, 3), (64, 64, 4, 4, 3), (64, 128, 4, 8, 4), (64, 128, 1, 4, 3)]
# (BLOCK_M, BLOCK_N, num_warps, num_stages); the first is the shipped one. Run CR also timed a software-pipelined
# variant, run CW keys merged in chunks of 128-512 at fixed positions, a program per chunk in a decode step (code not
# kept: docs/benchmarks.md, "Exact mode"); the shipped tiles also time a mask-free decode through an all-true mask,
# the kernel's work before "no mask" became a runtime flag
ATTENTION = [(16, 64, 2, 2), (16, 64, 4, 2), (16, 64, 1, 2), (16, 32, 2, 2), (16, 32, 1, 2), (16, 128, 2, 2),
             (16, 128, 4, 2), (32, 64, 2, 2)]


def _invariant(f, x) -> bool:
    big = f(x)
    return all(torch.equal(f(x[:m]), big[:m]) for m in SMALL)


def _ms(fn) -> float:
    return round(time_ms(fn, DEV, iters=5, warmup=2), 4)


def _layer_us(gemm, weights: dict, x: torch.Tensor, m: int) -> float:
    """The four GEMMs of one layer at ``m`` rows, in order, under CUDA-graph replay (a decode step's; their weights,
    192 MB in FP8, do not stay in L2 from one replay to the next), µs per layer."""
    inputs = {name: x[:m, :w_k].contiguous() for name, w_k in ((n, k) for n, (_, k) in LAYER.items())}

    def layer():
        for name in LAYER:
            gemm(inputs[name], weights[name])

    return round(graph_time_us(layer, DEV, calls=5, replays=10), 1)


def sweep_linear(rows: list) -> None:
    x = torch.randn(BIG, 12288, device=DEV, dtype=BF)
    weights = {name: torch.randn(n, k, device=DEV, dtype=BF) * 0.02 for name, (n, k) in LAYER.items()}
    weights["lm_head"] = torch.randn(151936, 4096, device=DEV, dtype=BF) * 0.02
    shipped = None  # the shipped tiles' o_proj output at BIG rows: does a candidate give the same bits?
    for cfg in LINEAR:
        exact_linear_triton.TILES.update(zip(("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLITS", "num_warps", "num_stages"),
                                             cfg))
        row = {"kernel": "exact linear", "tiles": cfg}
        try:
            def f(a, w):
                return exact_linear_triton.exact_linear_triton(a, w, None)

            o_out = f(x[:, :4096].contiguous(), weights["o"])
            shipped = o_out if shipped is None else shipped
            row["o bits = the shipped tiles'"] = torch.equal(o_out, shipped)

            for name, w in weights.items():
                xk = x[:, :w.shape[1]].contiguous()
                if name in ("o", "down", "lm_head"):
                    row[f"{name} invariant"] = _invariant(lambda a, w=w: f(a, w), xk)
                    splits = k_splits(-(-w.shape[1] // cfg[2]), cfg[3])[0]  # asked for: the default may not split
                    row[f"{name} runs as programs = in one"] = torch.equal(
                        exact_linear_triton.exact_linear_triton(xk[:64], w, None, programs_k=1),
                        exact_linear_triton.exact_linear_triton(xk[:64], w, None, programs_k=splits))
                row[f"{name} M={BIG} ms"] = _ms(lambda f=f, xk=xk, w=w: f(xk, w))
            for m in (64, 256):
                row[f"layer M={m} graph us"] = _layer_us(f, weights, x, m)
                row[f"lm_head M={m} graph us"] = round(graph_time_us(
                    lambda m=m: f(x[:m, :4096], weights["lm_head"]), DEV, calls=2, replays=10), 1)
        except Exception as e:  # noqa: BLE001 -- a tile that does not compile or fit: record it, go on
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        print(json.dumps(row), flush=True)


def sweep_fp8(rows: list) -> None:
    x = torch.randn(BIG, 12288, device=DEV, dtype=BF)
    weights = {name: quantize(torch.randn(n, k, device=DEV, dtype=BF) * 0.02, (128, 128))
               for name, (n, k) in LAYER.items()}
    codes = {m: {name: quantize(x[:m, :k].contiguous()) for name, (_, k) in LAYER.items()} for m in (64, 256, BIG)}
    def gemm(a, wq):  # the Triton exact kernel itself: exact mode sends these shapes to the Gluon kernel on Hopper
        return gemm_exact_triton.gemm_exact(a.codes, a.scales, wq.codes, wq.scales)

    shipped = None
    for cfg in FP8:
        gemm_exact_triton.TILES.update(zip(("BLOCK_M", "BLOCK_N", "SPLITS", "num_warps", "num_stages"), cfg))
        row = {"kernel": "exact fp8 gemm (Triton)", "tiles": cfg}
        try:
            with use_exact():
                o_out = gemm(codes[BIG]["o"], weights["o"])
                shipped = o_out if shipped is None else shipped
                row["o bits = the shipped tiles'"] = torch.equal(o_out, shipped)
                for name, (n, k) in LAYER.items():
                    wq = weights[name]

                    def f(a, wq=wq):
                        return gemm(quantize(a), wq)

                    if name in ("o", "down"):
                        row[f"{name} invariant"] = _invariant(f, x[:, :k].contiguous())
                        a = codes[64][name]
                        splits = k_splits(-(-k // 128), cfg[2])[0]  # asked for: the default may not split
                        row[f"{name} runs as programs = in one"] = torch.equal(
                            gemm_exact_triton.gemm_exact(a.codes, a.scales, wq.codes, wq.scales, programs_k=1),
                            gemm_exact_triton.gemm_exact(a.codes, a.scales, wq.codes, wq.scales, programs_k=splits))
                    row[f"{name} M={BIG} ms"] = _ms(lambda name=name, wq=wq: gemm(codes[BIG][name], wq))
                for m in (64, 256):
                    row[f"layer M={m} graph us"] = round(graph_time_us(
                        lambda m=m: [gemm(codes[m][name], weights[name]) for name in LAYER], DEV, calls=5,
                        replays=10), 1)
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        print(json.dumps(row), flush=True)


def sweep_attention(rows: list) -> None:
    B, H, Hkv, T, D = 8, 32, 8, 1152, 128
    q, k, v = (torch.randn(B, h, T, D, device=DEV, dtype=BF) for h in (H, Hkv, Hkv))
    # decode: B rows over a static cache of 1152, lengths 128..1151 (mean ~640); a BF16 cache and an FP8 one
    S = 1152
    cache = {}
    for Bd in (64, 256):
        kc, vc = (torch.randn(Bd, Hkv, S, D, device=DEV, dtype=BF) for _ in range(2))
        fp8 = [quantize_kv(x) for x in (kc, vc)]
        cache[Bd] = (torch.randn(Bd, H, 1, D, device=DEV, dtype=BF), kc, vc,
                     [x.codes.view(Bd, Hkv, S, D) for x in fp8], [x.scales.view(Bd, Hkv, S) for x in fp8],
                     torch.linspace(128, S - 1, Bd, device=DEV).long())
    rows_b = torch.arange(B, device=DEV)
    shipped = None
    for cfg in ATTENTION:
        exact_attention_triton.TILES.update(zip(("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"), cfg))
        row = {"kernel": "exact attention", "tiles": cfg}
        try:
            with use_exact():
                full = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                shipped = full if shipped is None else shipped
                row["bits = the shipped tiles'"] = torch.equal(full, shipped)
                pos = torch.tensor([0, 63, 64, 500, 700, 1000, 1100, T - 1], device=DEV)
                q_step = q[rows_b, :, pos].unsqueeze(2)
                row["invariant"] = torch.equal(exact_cache_attention(q_step, k, v, pos)[:, :, 0], full[rows_b, :, pos])
                tril = torch.ones(T, T, dtype=torch.bool, device=DEV).tril()[None, None]
                row["masked = causal"] = torch.equal(exact_attention_triton.exact_attention_triton(
                    q, k, v, tril, False, D ** -0.5), full)
                row["train 8x1152 causal ms"] = _ms(lambda: torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=True, enable_gqa=True))
                for Bd, (qd, kc, vc, codes, scales, lengths) in cache.items():
                    for kind, call in (("bf16", (qd, kc, vc, lengths)), ("fp8", (qd, *codes, lengths, *scales))):
                        row[f"decode B={Bd} {kind} cache graph us"] = round(graph_time_us(
                            lambda call=call: exact_cache_attention(*call), DEV, calls=4, replays=10), 1)
                    if cfg == ATTENTION[0]:  # the mask-free decode through an all-true mask (the kernel before)
                        ones = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=DEV)
                        masked = partial(exact_attention_triton.exact_attention_triton, qd, *codes, ones, False,
                                         D ** -0.5, lengths=lengths, k_scales=scales[0], v_scales=scales[1])
                        row[f"decode B={Bd} fp8 cache, all-true mask, graph us"] = round(graph_time_us(
                            masked, DEV, calls=4, replays=10), 1)
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        print(json.dumps(row), flush=True)


def main() -> None:
    rows: list = []
    for section in os.environ.get("SECTIONS", "attention,linear,fp8").split(","):
        {"linear": sweep_linear, "fp8": sweep_fp8, "attention": sweep_attention}[section](rows)
        torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "sweep_exact_tiles.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
