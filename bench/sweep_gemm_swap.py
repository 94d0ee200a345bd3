"""H200 sweep of a weight-major ("swapped") block-FP8 GEMM kernel against the shipped small-M kernel,
cuBLAS block FP8 and BF16, on the four decode GEMMs of an 8B layer at M = 1 ... 256. GPU only.

    PYTHONPATH=. OUT=/tmp python3 bench/sweep_gemm_swap.py          # SWEEP_ROWS=1,16,64 to narrow

The candidate puts the weight rows on the mma's M axis and the tokens on its N axis (``out^T = W a^T``):
BLOCK_N divides 128, so each (tile, group) has ONE weight scale (a scalar load, one FMUL per column for
``sa * sb``, then one FFMA per accumulator element), and M <= 16 runs FP8 wgmma (64x16x32) instead of
mma.sync on codes upcast to fp16. Measured and not taken (docs/benchmarks.md, section (c)): 3-5% faster
at M <= 16, slower at M = 64 and far slower at M >= 128; the shipped kernel stays.
"""

import itertools
import json
import os
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from jetrl.bench.kernels import _in_turn
from jetrl.bench.timing import graph_time_us
from jetrl.fp8.gemm import _scaled_mm, gemm_emulated
from jetrl.fp8.kernels.gemm_triton import gemm_small_m
from jetrl.fp8.kernels.split_k import store_tile, tile_counters
from jetrl.fp8.quant import quantize


@triton.jit
def _gemm_swap_kernel(
    a_ptr, sa_ptr, b_ptr, sb_ptr, out_ptr, work_ptr, count_ptr,
    M, N, K, stride_am, stride_bn, stride_sam, stride_sak, stride_sbn, stride_om,
    GROUPS_PER_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
):
    # weight rows are the mma's M (BLOCK_N divides 128: one weight scale per tile and group), tokens its N
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, 128)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    sb_base = sb_ptr + (pid_n * BLOCK_N // 128) * stride_sbn
    for i in range(GROUPS_PER_SPLIT):
        g = pid_k * GROUPS_PER_SPLIT + i
        k = g * 128 + offs_k
        k_ok = k < K
        b = tl.load(b_ptr + cols[:, None] * stride_bn + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(a_ptr + rows[:, None] * stride_am + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        group_ok = g * 128 < K
        sa = tl.load(sa_ptr + rows * stride_sam + g * stride_sak, mask=row_ok & group_ok, other=0.0)
        sb = tl.load(sb_base + g, mask=group_ok, other=0.0)
        partial = tl.dot(b, tl.trans(a), out_dtype=tl.float32)  # (BLOCK_N, BLOCK_M)
        acc += partial * (sa * sb)[None, :]
    # stored as (tokens, weight rows), the output's orientation: coalesced (the first call also timed the
    # untransposed store; it was the same within 0.1 µs)
    tile_id = pid_m * tl.num_programs(0) + pid_n
    out = out_ptr + rows[:, None] * stride_om + cols[None, :]
    work = work_ptr + rows[:, None] * N + cols[None, :]
    store_tile(tl.trans(acc), out, work, row_ok[:, None] & col_ok[None, :], count_ptr + tile_id, pid_k, M * N,
               SPLIT_K)


SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288)]


def swap(xq, wq, cfg, out_dtype=torch.bfloat16):
    bm, bn, sk, nw, ns = cfg
    m, k = xq.codes.shape
    n = wq.codes.shape[0]
    gps = triton.cdiv(triton.cdiv(k, 128), sk)
    out = torch.empty(m, n, dtype=out_dtype, device="cuda")
    work = torch.empty(sk, m, n, device="cuda") if sk > 1 else out
    cnt = tile_counters(out.device)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), sk)
    _gemm_swap_kernel[grid](xq.codes, xq.scales, wq.codes, wq.scales, out, work, cnt, m, n, k, xq.codes.stride(0),
                            wq.codes.stride(0), xq.scales.stride(0), xq.scales.stride(1), wq.scales.stride(0),
                            out.stride(0), GROUPS_PER_SPLIT=gps, SPLIT_K=sk, BLOCK_N=bn, BLOCK_M=bm,
                            num_warps=nw, num_stages=ns)
    return out


def grid_for(m):
    if m <= 16:
        return list(itertools.product([16], [64, 128], [1, 2, 4, 8], [4], [4, 6]))
    if m <= 64:
        return list(itertools.product([64], [64, 128], [1, 2, 4, 8], [4], [3, 4]))
    return ([(128, 128, s, 8, st) for s in (1, 2, 4) for st in (3, 4)]
            + [(64, 128, s, 4, st) for s in (1, 2, 4) for st in (3, 4)]
            + [(128, 64, s, 4, st) for s in (1, 2) for st in (3, 4)])


def graph_us(fns):
    return graph_time_us(_in_turn(fns), torch.device("cuda"), calls=20, replays=10)


def main() -> None:
    out_dir = os.environ.get("OUT", "/tmp")
    rows_env = os.environ.get("SWEEP_ROWS")
    ROWS = tuple(int(v) for v in rows_env.split(",")) if rows_env else (1, 16, 64, 128, 256)
    torch.manual_seed(0)
    results = []
    t0 = time.time()
    for name, n, k in SHAPES:
        copies = max(2, -(-150_000_000 // (n * k)))
        wq = [quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, (128, 128)) for _ in range(copies)]
        wbf = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq = quantize(x)
            ref = gemm_emulated(xq, wq[0], torch.float32)
            row = {"shape": name, "m": m,
                   "bf16": graph_us([lambda w=w: F.linear(x, w) for w in wbf]),
                   "cublas": graph_us([lambda q=q: _scaled_mm(xq, q, torch.bfloat16) for q in wq]),
                   "small_m": graph_us([lambda q=q: gemm_small_m(xq.codes, xq.scales, q.codes, q.scales) for q in wq])
                   if m <= 64 else None,
                   "swap": {}}
            for cfg in grid_for(m):
                try:
                    got = swap(xq, wq[0], cfg, torch.float32)
                    err = float((got - ref).norm() / ref.norm())
                    if not err < 2e-3:
                        raise AssertionError(f"rel err {err:.1e}")
                    row["swap"][str(cfg)] = graph_us([lambda q=q: swap(xq, q, cfg) for q in wq])
                except Exception as exc:  # noqa: BLE001
                    row["swap"][str(cfg)] = f"error {str(exc)[:100]}"
            ok = {c: v for c, v in row["swap"].items() if isinstance(v, float)}
            top = sorted(ok.items(), key=lambda kv: kv[1])[:3]
            results.append(row)
            sm = f"{row['small_m']:.1f}" if row["small_m"] else "-"
            print(f"{name:8s} M={m:3d} bf16 {row['bf16']:6.1f} cublas {row['cublas']:6.1f} small_m {sm} | swap "
                  + ", ".join(f"{c} {v:.1f}" for c, v in top) + f"  ({time.time() - t0:.0f}s)", flush=True)
    with open(os.path.join(out_dir, "sweep_gemm_swap.json"), "w") as f:
        json.dump(results, f, indent=1)
    for m in ROWS:
        rs = [r for r in results if r["m"] == m]
        best = sum(min(v for v in r["swap"].values() if isinstance(v, float)) for r in rs)
        sm = sum(r["small_m"] for r in rs) if m <= 64 else float("nan")
        print(f"M={m}: sums bf16 {sum(r['bf16'] for r in rs):.1f} cublas {sum(r['cublas'] for r in rs):.1f} "
              f"small_m {sm:.1f} swap(best per shape) {best:.1f}")


if __name__ == "__main__":
    main()
