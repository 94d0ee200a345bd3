"""Probe: does programmatic dependent launch (PDL) shorten a chain of small decode-size kernels
under CUDA-graph replay? GPU (sm90+) only; prints µs per chain with and without PDL, and checks
that the results are identical.

    PYTHONPATH=. OUT=/tmp python3 bench/probe_pdl.py
"""

import json
import os

import torch
import triton
import triton.language as tl

from jetrl.bench.timing import graph_time_us


@triton.jit
def _rowop(x_ptr, y_ptr, K: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    row = tl.program_id(0)
    if PDL:
        if EARLY:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    offs = tl.arange(0, K)
    x = tl.load(x_ptr + row * K + offs).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / K + 1e-6)
    tl.store(y_ptr + row * K + offs, (x * r).to(tl.bfloat16))


@triton.jit
def _gemm(x_ptr, w_ptr, y_ptr, N, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
          PDL: tl.constexpr, EARLY: tl.constexpr, PREFETCH: tl.constexpr):
    pid = tl.program_id(0)
    offs_m, offs_n, offs_k = tl.arange(0, BM), pid * BN + tl.arange(0, BN), tl.arange(0, BK)
    w_ptrs = w_ptr + offs_n[None, :] * K + offs_k[:, None]
    acc = tl.zeros([BM, BN], tl.float32)
    if PDL:
        if EARLY:
            tl.extra.cuda.gdc_launch_dependents()
    if PREFETCH:  # the weights do not depend on the previous kernel: start streaming them first
        w0 = tl.load(w_ptrs)
        tl.extra.cuda.gdc_wait()
        x = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :])
        acc += tl.dot(x, w0.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16))
        k_start = BK
    else:
        if PDL:
            tl.extra.cuda.gdc_wait()
        k_start = 0
    for k0 in range(k_start, K, BK):
        x = tl.load(x_ptr + offs_m[:, None] * K + (k0 + offs_k)[None, :])
        w = tl.load(w_ptrs + k0)
        acc += tl.dot(x, w.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16))
    tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(tl.bfloat16))


def main() -> None:
    dev = torch.device("cuda")
    M, K = 64, 4096
    copies = 8
    ws = [torch.randint(0, 120, (K, K), dtype=torch.uint8, device=dev) for _ in range(copies)]  # 16 MB each
    x0 = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    bufs = [torch.empty(M, K, device=dev, dtype=torch.bfloat16) for _ in range(2)]
    rows = []

    def chain(pdl: bool, early: bool, prefetch: bool, n_layers: int = 8):
        def run():
            x = x0
            for i in range(n_layers):
                _rowop[(M,)](x, bufs[0], K=K, PDL=pdl, EARLY=early, launch_pdl=pdl, num_warps=4)
                _gemm[(K // 32,)](bufs[0], ws[i % copies], bufs[1], K, K=K, BM=64, BN=32, BK=128,
                                  PDL=pdl, EARLY=early, PREFETCH=prefetch, launch_pdl=pdl, num_warps=4, num_stages=4)
                x = bufs[1]
            return bufs[1].clone()
        return run

    ref = chain(False, False, False)()
    for pdl, early, prefetch in [(False, False, False), (True, False, False), (True, True, False), (True, True, True),
                                 (False, False, False)]:
        fn = chain(pdl, early, prefetch)
        out = fn()
        same = bool(torch.equal(out, ref))
        # graph: the chain captured 4 times per replay
        us = graph_time_us(fn, dev, calls=4, replays=20)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            got = fn()
        g.replay()
        torch.cuda.synchronize()
        same_graph = bool(torch.equal(got, ref))
        row = {"pdl": pdl, "early": early, "prefetch": prefetch, "us_per_chain_of_16": us, "equal": same,
               "equal_in_graph": same_graph}
        rows.append(row)
        print(row, flush=True)
    json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "pdl.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
