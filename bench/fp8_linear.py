"""GPU checks and timings of the FP8 core: quantizer, block-FP8 GEMM, Float8Linear vs BF16.

Run on an SM90 GPU from the repository root:

    PYTHONPATH=. python bench/fp8_linear.py [--out DIR]

Correctness first, in the same run as the timings:
  * the quantizer on the GPU (eager reference and the compiled backend) gives codes and
    scales bit-identical to the CPU reference;
  * ``F.scaled_mm`` agrees with the emulated GEMM (the spec) for the fprop, dgrad and wgrad
    operand layouts, including M=1 and K=576 (a partial 128-group);
  * Float8Linear's y, dx, dw against an fp32 reference (SQNR, dB).
Then times Float8Linear forward and forward+backward against BF16 ``nn.Linear`` at Qwen3-8B
shapes (M = 8192 tokens; K, N in {4096, 12288}), quantization included, with CUDA events
(median of repeated runs on random data). Prints a table last and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn as nn

from jetrl.fp8 import Float8Linear, fp8_gemm, gemm_emulated, get_recipe, override_backend, quantize
from jetrl.fp8.quant import quantize_reference

DEV = "cuda"


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t.view(torch.int32)


def time_ms(fn, iters: int = 20, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def sqnr(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.detach().double(), ref.detach().double()
    return float(20 * torch.log10(ref.norm() / (a - ref).norm()))


def check_quantizer() -> list[dict]:
    rows = []
    cases = [((8192, 4096), torch.bfloat16, (1, 128)), ((300, 576), torch.float32, (1, 128)),
             ((4096, 12288), torch.bfloat16, (128, 128)), ((200, 576), torch.float32, (128, 128))]
    for shape, dtype, block in cases:
        for pow2 in (False, True):
            x = (torch.randn(shape) * torch.exp(2 * torch.randn(shape))).to(dtype)
            x[0, 3] = float("nan")
            cpu_codes, cpu_scales = quantize_reference(x, *block, pow2)
            xg = x.to(DEV)
            eager = quantize_reference(xg, *block, pow2)
            fast = quantize(xg, block, pow2_scale=pow2)  # the CUDA backend (Triton)
            row = {"shape": list(shape), "dtype": str(dtype), "block": list(block), "pow2": pow2}
            for label, (c, s) in (("eager", eager), ("triton", (fast.codes, fast.scales))):
                row[f"{label}_codes_equal"] = bool(torch.equal(u8(c.cpu()), u8(cpu_codes)))
                # NaN scales compare as bit patterns too
                row[f"{label}_scales_equal"] = bool(torch.equal(u8(s.cpu()), u8(cpu_scales)))
            rows.append(row)
    return rows


def sweep_quant_tiles() -> list[dict]:
    """1x128 quantization of an (8192, 4096) bf16 tensor and of its transpose, per tile config."""
    from jetrl.fp8.kernels.quant_triton import quantize_triton

    x = torch.randn(8192, 4096, device=DEV, dtype=torch.bfloat16)
    rows = []
    for tile_rows in (16, 32, 64, 128):
        for num_warps in (2, 4, 8):
            for transpose in (False, True):
                src = x.t() if transpose else x
                ms = time_ms(lambda: quantize_triton(src, 1, 128, False, tile_rows=tile_rows, num_warps=num_warps))
                rows.append({"tile_rows": tile_rows, "num_warps": num_warps, "transposed": transpose, "ms": ms,
                             "tb_s": 3 * x.numel() / (ms * 1e-3) / 1e12})
    return rows


def check_gemm() -> list[dict]:
    rows = []
    for m, n, k in [(1, 4096, 4096), (16, 12288, 4096), (256, 1536, 576), (8192, 4096, 4096), (4096, 4096, 8192)]:
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02
        dy = torch.randn(m, n, device=DEV, dtype=torch.bfloat16)
        wq = quantize(w, (128, 128))
        layouts = {
            "fprop": (quantize(x), wq),
            "dgrad": (quantize(dy), wq.t()),
            "wgrad": (quantize(dy.t().contiguous()), quantize(x.t().contiguous())),
        }
        for name, (a, b) in layouts.items():
            spec = gemm_emulated(a, b, torch.float32)
            try:
                with override_backend("scaled_mm"):
                    fast = fp8_gemm(a, b, torch.float32)
                rel = float((fast - spec).norm() / spec.norm())
                err = None
            except Exception as e:  # report, do not hide: the table shows it
                rel, err = float("nan"), f"{type(e).__name__}: {str(e)[:600]}"
            rows.append({"gemm": name, "m": m, "n": n, "k": k, "rel_err_vs_emulated": rel, "error": err})
            if err:
                print(f"{name} {m}x{n}x{k}: {err}")
    return rows


def bench_linear(m: int, k: int, n: int) -> dict:
    torch.manual_seed(0)
    ref32 = nn.Linear(k, n, bias=False, device=DEV)
    bf16 = nn.Linear(k, n, bias=False, device=DEV, dtype=torch.bfloat16)
    with torch.no_grad():
        bf16.weight.copy_(ref32.weight)
    fp8 = Float8Linear.from_float(bf16, get_recipe("jet"), name=f"linear_{k}x{n}")
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    dy = torch.randn(m, n, device=DEV, dtype=torch.bfloat16)

    # accuracy vs fp32
    x32 = x.float().requires_grad_()
    y32 = ref32(x32)
    y32.backward(dy.float())
    xf = x.clone().requires_grad_()
    y8 = fp8(xf)
    y8.backward(dy)
    acc = {"sqnr_y": sqnr(y8, y32), "sqnr_dx": sqnr(xf.grad, x32.grad), "sqnr_dw": sqnr(fp8.weight.grad, ref32.weight.grad)}

    xg = x.clone().requires_grad_()

    def fwd(mod):
        return lambda: mod(x)

    def fwd_bwd(mod):
        def run():
            mod.weight.grad = None
            xg.grad = None
            mod(xg).backward(dy)
        return run

    with torch.no_grad():
        t_fwd_bf16, t_fwd_fp8 = time_ms(fwd(bf16)), time_ms(fwd(fp8))
    t_fb_bf16, t_fb_fp8 = time_ms(fwd_bwd(bf16)), time_ms(fwd_bwd(fp8))
    # where the FP8 time goes: the three GEMMs alone, and the activation quantization alone
    wq = fp8.weight_cache.get(fp8.weight, get_recipe("jet").train.weight)
    xq, dyq = quantize(x), quantize(dy)
    dytq, xtq, wtq = quantize(dy.t()), quantize(x.t()), wq.t()
    t_gemms = time_ms(lambda: (fp8_gemm(xq, wq), fp8_gemm(dyq, wtq), fp8_gemm(dytq, xtq, torch.float32)))
    t_quant = time_ms(lambda: (quantize(x), quantize(x.t()), quantize(dy), quantize(dy.t())))
    t_wquant = time_ms(lambda: quantize(bf16.weight, (128, 128)))
    t_q1 = time_ms(lambda: quantize(x))  # one 1x128 pass: 2 B read + 1 B written per element
    t_gemms_bf16 = time_ms(lambda: (x @ bf16.weight.t(), dy @ bf16.weight, dy.t() @ x))
    flops = 2 * m * n * k
    return {
        "m": m, "k": k, "n": n, **acc,
        "fwd_ms_bf16": t_fwd_bf16, "fwd_ms_fp8": t_fwd_fp8, "fwd_speedup": t_fwd_bf16 / t_fwd_fp8,
        "fwdbwd_ms_bf16": t_fb_bf16, "fwdbwd_ms_fp8": t_fb_fp8, "fwdbwd_speedup": t_fb_bf16 / t_fb_fp8,
        "gemms_ms_bf16": t_gemms_bf16, "gemms_ms_fp8": t_gemms, "gemms_speedup": t_gemms_bf16 / t_gemms,
        "act_quant_ms": t_quant, "quant_1x128_ms": t_q1, "quant_1x128_tb_s": 3 * m * k / (t_q1 * 1e-3) / 1e12, "weight_quant_ms": t_wquant,
        # 4 quantizations (x, x^T, dy, dy^T): each reads 2 B/elem (bf16) and writes 1 B/elem codes
        "act_quant_tb_s": 6 * (m * k + m * n) / (t_quant * 1e-3) / 1e12,
        "fp8_tflops_fwdbwd": 3 * flops / (t_fb_fp8 * 1e-3) / 1e12,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    env = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "cuda": torch.version.cuda}
    print(json.dumps(env))
    quant_rows = check_quantizer()
    gemm_rows = check_gemm()
    sweep_rows = sweep_quant_tiles()
    linear_rows = []
    for k, n in [(4096, 4096), (4096, 12288), (12288, 4096), (12288, 12288)]:
        try:
            linear_rows.append(bench_linear(8192, k, n))
        except Exception as e:  # keep the other shapes; the failure is printed and fails the run
            print(f"bench_linear {k}x{n} failed: {type(e).__name__}: {e}")
            return 1
        print(json.dumps(linear_rows[-1]))
    result = {"env": env, "quantizer": quant_rows, "gemm": gemm_rows, "quant_tiles": sweep_rows, "linear": linear_rows}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_fp8_linear.json"), "w") as f:
        json.dump(result, f, indent=1)

    print("\nquantizer bit-equality vs CPU reference (eager torch / Triton kernel):")
    for r in quant_rows:
        print(f"  {r['shape']} {r['dtype']:>14} block {r['block']} pow2={r['pow2']!s:5}  "
              f"eager {r['eager_codes_equal'] and r['eager_scales_equal']}  "
              f"triton {r['triton_codes_equal'] and r['triton_scales_equal']}")
    print("\nscaled_mm vs emulated (relative error):")
    for r in gemm_rows:
        print(f"  {r['gemm']:5} M={r['m']:5} N={r['n']:5} K={r['k']:5}  {r['rel_err_vs_emulated']:.2e}  {r['error'] or ''}")
    print("\n1x128 quant tile sweep, (8192, 4096) bf16 (TB/s; plain / transposed read):")
    for i in range(0, len(sweep_rows), 2):
        a, b = sweep_rows[i], sweep_rows[i + 1]
        print(f"  tile_rows {a['tile_rows']:3} warps {a['num_warps']}  {a['tb_s']:.2f} / {b['tb_s']:.2f}")
    print("\nFloat8Linear (jet) vs BF16 nn.Linear, M=8192, ms (median):")
    print("   K x N        fwd bf16  fwd fp8  ratio | f+b bf16  f+b fp8  ratio | 3 GEMMs ratio | act quant ms (1x128 TB/s) | SQNR y/dx/dw")
    for r in linear_rows:
        print(f"  {r['k']:5}x{r['n']:<5}  {r['fwd_ms_bf16']:8.3f} {r['fwd_ms_fp8']:8.3f} {r['fwd_speedup']:6.2f} | "
              f"{r['fwdbwd_ms_bf16']:8.3f} {r['fwdbwd_ms_fp8']:8.3f} {r['fwdbwd_speedup']:6.2f} | "
              f"{r['gemms_speedup']:13.2f} | {r['act_quant_ms']:6.3f} ({r['quant_1x128_tb_s']:.2f} TB/s) | "
              f"{r['sqnr_y']:.1f}/{r['sqnr_dx']:.1f}/{r['sqnr_dw']:.1f}")
    ok = all(r[f"{b}_{t}_equal"] for r in quant_rows for b in ("eager", "triton") for t in ("codes", "scales")) and all(
        r["rel_err_vs_emulated"] < 5e-3 for r in gemm_rows)
    print(json.dumps({"checks_pass": ok, "fwdbwd_speedup": [round(r["fwdbwd_speedup"], 3) for r in linear_rows]}))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
