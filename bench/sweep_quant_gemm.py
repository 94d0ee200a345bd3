"""The H200 sweep behind section (a)/(c) defaults: quantizer tiles (software vs hardware RNE cast),
small-M GEMM tile configurations per decode shape, Float8Linear back-to-back timings, and a
torch.profiler table of one 4096x4096 Float8Linear fwd+bwd. GPU only; writes $OUT/dev_kernels.json.

    PYTHONPATH=. OUT=/tmp python3 bench/sweep_quant_gemm.py
"""

import json
import os
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from jetrl.fp8 import Float8Linear, get_recipe
from jetrl.fp8.gemm import _scaled_mm, gemm_emulated
from jetrl.fp8.kernels.gemm_triton import SmallMConfig, gemm_small_m
from jetrl.fp8.kernels.quant_triton import quantize_dual_triton, quantize_triton
from jetrl.fp8.quant import quantize, quantize_reference


def main() -> None:
    DEV = "cuda"
    OUT = os.environ.get("OUT", "/tmp")
    res = {}

    def bits(t):
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t.view(torch.int32)

    def t_ev(fn, iters=20, warm=5):
        for _ in range(warm):
            fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(iters):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            ts.append(s.elapsed_time(e))
        return statistics.median(ts)

    def t_graph(fn, calls=20, reps=10):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(calls):
                fn()
        g.replay()
        torch.cuda.synchronize()
        ts = []
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            g.replay()
            e.record()
            torch.cuda.synchronize()
            ts.append(s.elapsed_time(e) / calls)
        return statistics.median(ts) * 1000  # us

    t0 = time.time()

    def t_loop(fn, n=10):
        return t_ev(lambda: [fn() for _ in range(n)]) / n

    x = torch.randn(8192, 4096, device=DEV, dtype=torch.bfloat16)
    x[5, 7] = float("nan")
    x[9, 1] = float("-inf")
    y = torch.empty_like(x)
    nb = x.numel() * 2
    res["copy_tb_s"] = 2 * nb / t_loop(lambda: y.copy_(x)) / 1e9
    want = (*quantize_reference(x, 1, 128, False), *quantize_reference(x.t(), 1, 128, False))
    w = torch.randn(12288, 4096, device=DEV, dtype=torch.bfloat16)
    wref = quantize_reference(w, 128, 128, False)
    kv = torch.randn(256 * 8 * 4, 128, device=DEV, dtype=torch.bfloat16)
    for mode in ("0", "1"):
        os.environ["JETRL_QUANT_EXPLICIT_ROUND"] = mode
        got = quantize_dual_triton(x, False)
        res[f"dual_equal_explicit{mode}"] = all(torch.equal(bits(g), bits(w_)) for g, w_ in zip(got, want))
        gw = quantize_triton(w, 128, 128, False)
        res[f"w_equal_explicit{mode}"] = all(torch.equal(bits(g), bits(w_)) for g, w_ in zip(gw, wref))
        for nw in (4, 8):
            res[f"dual_tb_s_e{mode}_w{nw}"] = (
                2 * nb / t_loop(lambda: quantize_dual_triton(x, False, num_warps=nw)) / 1e9
            )
        for tr in (8, 16, 32, 64):
            for nw in (2, 4, 8):
                res[f"row_tb_s_e{mode}_tr{tr}_w{nw}"] = (
                    1.5 * nb / t_loop(lambda: quantize_triton(x, 1, 128, False, tile_rows=tr, num_warps=nw)) / 1e9
                )
        res[f"w128_tb_s_e{mode}"] = 1.5 * w.numel() * 2 / t_loop(lambda: quantize_triton(w, 128, 128, False)) / 1e9
        res[f"kv_tb_s_e{mode}"] = 1.5 * kv.numel() * 2 / t_loop(lambda: quantize_triton(kv, 1, 128, False)) / 1e9
    os.environ["JETRL_QUANT_EXPLICIT_ROUND"] = "0"
    print(
        "quant", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in res.items()}, time.time() - t0, flush=True
    )
    gem = []
    for n, k, name in [(6144, 4096, "qkv"), (4096, 4096, "o"), (24576, 4096, "gate_up"), (4096, 12288, "down")]:
        wb = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02
        wq = quantize(wb, (128, 128))
        for m in (1, 16, 32, 64):
            xa = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            aq = quantize(xa)
            ref = gemm_emulated(aq, wq, torch.float32)
            row = {"name": name, "m": m, "n": n, "k": k, "floor_us": n * k / 4.3e12 * 1e6}
            row["bf16_us"] = t_graph(lambda: F.linear(xa, wb))
            row["cublas_us"] = t_graph(lambda: _scaled_mm(aq, wq, torch.bfloat16))
            best = (1e9, None)
            errs = []
            bms = [16] if m <= 16 else ([32] if m <= 32 else [64])
            for bm in bms:
                for bn in (64, 128):
                    for sk in (1, 2, 4, 8):
                        for st in (3, 4):
                            for nw in (4,) if bm <= 32 else (4, 8):
                                cfg = SmallMConfig(bm, bn, sk, nw, st)
                                try:
                                    out = gemm_small_m(aq.codes, aq.scales, wq.codes, wq.scales, torch.float32, cfg)
                                    errs.append(float((out - ref).norm() / ref.norm()))
                                    us = t_graph(
                                        lambda: gemm_small_m(
                                            aq.codes, aq.scales, wq.codes, wq.scales, torch.bfloat16, cfg
                                        ),
                                        calls=10,
                                        reps=5,
                                    )
                                except Exception as e:
                                    print("fail", cfg, repr(e)[:200])
                                    continue
                                if us < best[0]:
                                    best = (us, str(cfg))
            row["triton_best_us"], row["best_cfg"], row["max_err"] = best[0], best[1], max(errs)
            gem.append(row)
            print(row, flush=True)
    res["gemm"] = gem
    print("gemm done", time.time() - t0, flush=True)
    # ---- Float8Linear
    lin = []
    for k, n in [(4096, 4096), (4096, 6144), (4096, 24576), (12288, 4096)]:
        m = 8192
        base = nn.Linear(k, n, bias=False, device=DEV, dtype=torch.bfloat16)
        f8 = Float8Linear.from_float(nn.Linear(k, n, bias=False, device=DEV, dtype=torch.bfloat16), get_recipe("jet"))
        xx = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        gy = torch.randn(m, n, device=DEV, dtype=torch.bfloat16)

        def fb(mod):
            def f():
                mod.weight.grad = None
                xx.grad = None
                mod(xx).backward(gy)

            return f

        with torch.no_grad():
            fwd_b = t_loop(lambda: base(xx))
            fwd_f = t_loop(lambda: f8(xx))
        fb_b = t_loop(fb(base))
        fb_f = t_loop(fb(f8))
        r = {
            "k": k,
            "n": n,
            "fwd_ratio": fwd_b / fwd_f,
            "fwdbwd_ratio": fb_b / fb_f,
            "bf16_fb_ms": fb_b,
            "fp8_fb_ms": fb_f,
        }
        lin.append(r)
        print(r, flush=True)
    res["linear"] = lin
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    k, n = 4096, 4096
    f8 = Float8Linear.from_float(nn.Linear(k, n, bias=False, device=DEV, dtype=torch.bfloat16), get_recipe("jet"))
    xx = torch.randn(8192, k, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(8192, n, device=DEV, dtype=torch.bfloat16)
    for _ in range(3):
        f8(xx).backward(gy)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            f8(xx).backward(gy)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
    json.dump(res, open(f"{OUT}/dev_kernels.json", "w"), indent=1)
    print("total", time.time() - t0)


if __name__ == "__main__":
    main()
