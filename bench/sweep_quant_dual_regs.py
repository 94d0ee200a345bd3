"""The dual-layout quantizer (x and x^T in 1x128 groups, one pass) with no layout change through shared memory.

Every earlier candidate (sweep_quant_dual_v2.py, sweep_quant_dual_tma.py) moved x^T's codes -- or x itself --
between a layout that reads x along K and one that writes x^T along M, through shared memory, and Nsight Compute
put the shipped pass's time there (bank conflicts) and in latency (docs/benchmarks.md (a)). This candidate needs no
such move: each thread loads a (SPT_M x 8) block of x -- SPT_M consecutive rows, 8 consecutive columns, one 16-byte
load per row -- so it holds, for each of its 8 columns, SPT_M *consecutive* elements of x^T's row. Both layouts are
quantized from the same registers by the quantizer's own row function (``_quantize_rows``; x^T's through
``gl.permute``, which moves no data): x's group maxima reduce over 16 lanes, x^T's over the thread's rows, one lane
and the warps (a 128-float exchange). x's codes leave as 8-byte stores per row, x^T's as SPT_M-byte stores per
column, the registers reordered within each thread (a linear layout whose lanes and warps are the load's).

Checked bit for bit against the shipped pass (itself checked against ``quantize_reference`` by the bench), NaN groups
and pow2 scales included, then timed under CUDA-graph replay against it. GPU only; ``SASS_ONLY=1`` compiles each
candidate for sm_90 on any machine and prints its memory instructions.

    PYTHONPATH=. OUT=$OUT python3 bench/sweep_quant_dual_regs.py

Result (run GD, docs/benchmarks.md (a)): bit-equal at every shape and 0.50-0.75x the shipped pass (best 16 x 8 rows
with the bare cast, 1.64-1.70 TB/s against 2.21-2.44). The compiler keeps each thread's block in fp32: 102 / 188 / 255
registers at 4 x 8 / 8 x 8 / 16 x 8 elements per thread, one CTA per SM (8-16 warps), so it is latency-bound where the
shipped pass holds 16 warps per SM; fewer elements per thread break x^T's stores into partial 32-byte sectors.
"""

import collections
import functools
import json
import os
import re
from functools import partial

import torch
import triton

from jetrl.fp8.kernels.quant_triton import _quantize_rows
from jetrl.fp8.quant import E4M3


def layouts(spt_m: int, spt_k: int = 8):
    """(L, LT, num_warps): x's (128 m, 128 k) layout -- SPT_M x SPT_K elements per thread, k fastest in its
    registers, 128 / SPT_K lanes along k, the other lanes along m, the warps along m -- and x^T's (128 k, 128 m)
    layout with the same thread owning the same elements, m fastest in its registers."""
    from triton.experimental.gluon import language as gl

    def log2(n):
        return n.bit_length() - 1

    lanes_k = 128 // spt_k
    lanes_m = 32 // lanes_k
    warps = 128 // (spt_m * lanes_m)
    k_regs, m_regs = [[0, 1 << i] for i in range(log2(spt_k))], [[1 << i, 0] for i in range(log2(spt_m))]
    k_lanes = [[0, spt_k << i] for i in range(log2(lanes_k))]
    m_lanes = [[spt_m << i, 0] for i in range(log2(lanes_m))]
    m_warps = [[spt_m * lanes_m << i, 0] for i in range(log2(warps))]
    x_layout = gl.DistributedLinearLayout(k_regs + m_regs, k_lanes + m_lanes, m_warps, [], [128, 128])

    def swap(bases):
        return [[b[1], b[0]] for b in bases]

    xt_layout = gl.DistributedLinearLayout(swap(m_regs) + swap(k_regs), swap(k_lanes + m_lanes), swap(m_warps), [],
                                           [128, 128])
    return x_layout, xt_layout, warps


@functools.cache
def _kernel():
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    @gluon.jit
    def _dual_regs(x_ptr, codes_ptr, scales_ptr, codes_t_ptr, scales_t_ptr, M, K, stride_xm, stride_sm, stride_sg,
                   stride_tk, stride_tg, POW2: gl.constexpr, BARE: gl.constexpr, L: gl.constexpr,
                   LT: gl.constexpr):
        pid_k, pid_m = gl.program_id(0), gl.program_id(1)
        rows = pid_m.to(gl.int64) * 128 + gl.arange(0, 128, layout=gl.SliceLayout(1, L))
        cols = pid_k * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, L))
        mask = (rows < M)[:, None] & (cols < K)[None, :]
        x = gl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(gl.float32)
        code_bits, scale = _quantize_rows(x, POW2, False, BARE)
        gl.store(codes_ptr + rows[:, None] * K + cols[None, :], code_bits, mask=mask)
        gl.store(scales_ptr + rows * stride_sm + pid_k * stride_sg, scale, mask=rows < M)
        code_t, scale_t = _quantize_rows(gl.permute(x, [1, 0]), POW2, False, BARE)
        code_t = gl.convert_layout(code_t, LT)  # the same threads: a reorder of each thread's registers
        kt = pid_k * 128 + gl.arange(0, 128, layout=gl.SliceLayout(1, LT))
        mt = pid_m.to(gl.int64) * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, LT))
        gl.store(codes_t_ptr + kt.to(gl.int64)[:, None] * M + mt[None, :], code_t,
                 mask=(kt < K)[:, None] & (mt < M)[None, :])
        kt_s = pid_k * 128 + gl.arange(0, 128, layout=scale_t.type.layout)
        gl.store(scales_t_ptr + kt_s * stride_tk + pid_m * stride_tg, scale_t, mask=kt_s < K)

    return _dual_regs


def dual_regs(x: torch.Tensor, pow2: bool, spt_m: int, bare: bool, spt_k: int = 8):
    m, k = x.shape
    codes = torch.empty((m, k), dtype=E4M3, device=x.device)
    codes_t = torch.empty((k, m), dtype=E4M3, device=x.device)
    scales = torch.empty((m, triton.cdiv(k, 128)), dtype=torch.float32, device=x.device)
    scales_t = torch.empty((k, triton.cdiv(m, 128)), dtype=torch.float32, device=x.device)
    x_layout, xt_layout, warps = layouts(spt_m, spt_k)
    _kernel()[(triton.cdiv(k, 128), triton.cdiv(m, 128))](
        x, codes.view(torch.uint8), scales, codes_t.view(torch.uint8), scales_t, m, k, x.stride(0), *scales.stride(),
        *scales_t.stride(), POW2=pow2, BARE=bare, L=x_layout, LT=xt_layout, num_warps=warps)
    return codes, scales, codes_t, scales_t


# (SPT_M, SPT_K, bare cast): what run GD timed. Layouts whose x^T stores fill whole 32-byte sectors (SPT_M x the
# lanes along m = 32: 32 x 4, 16 x 8, 8 x 16, 4 x 32) hold 128 elements per thread and compile to 255 registers
# (``SASS_ONLY=1 CANDIDATES=sectors``): two 4-warp CTAs per SM at most
CANDIDATES = [(s, 8, bare) for s in (8, 16, 4) for bare in (True, False)]
if os.environ.get("CANDIDATES") == "sectors":
    CANDIDATES = [(16, 8, True), (32, 4, True), (8, 16, True), (4, 32, True)]


def sass_only() -> None:
    from jetrl.bench.sass import compile_like_launch, registers, sass

    m, k = 9216, 4096
    ptrs = {"x_ptr": torch.empty(1, dtype=torch.bfloat16), "codes_ptr": torch.empty(1, dtype=torch.uint8),
            "scales_ptr": torch.empty(1), "codes_t_ptr": torch.empty(1, dtype=torch.uint8),
            "scales_t_ptr": torch.empty(1)}
    dims = {"M": m, "K": k, "stride_xm": k, "stride_sm": k // 128, "stride_sg": 1, "stride_tk": m // 128,
            "stride_tg": 1}
    for spt_m, spt_k, bare in CANDIDATES:
        x_layout, xt_layout, warps = layouts(spt_m, spt_k)
        compiled = compile_like_launch(_kernel(), {**ptrs, **dims}, {"POW2": False, "BARE": bare, "L": x_layout,
                                                                     "LT": xt_layout}, num_warps=warps, num_stages=1)
        text = sass(compiled)
        ops = collections.Counter(re.findall(r"\b((?:LDG|STG|LDS|STS|SHFL|BAR)[.\w]*)", text))
        total = len(re.findall(r"^\s+/\*[0-9a-f]{4,6}\*/", text, re.MULTILINE))
        regs = registers(compiled)
        print(f"{spt_m} x {spt_k} bare {bare}, warps {warps}: {total} SASS instructions, shared {compiled.metadata.shared} B, "
              f"{dict(sorted(ops.items()))}, {regs} registers")


def shipped_baseline(m: int, k: int, dev: torch.device) -> tuple:
    """(x, refs, bytes, µs, row) for an (m, k) sweep shape: a random bf16 x with a NaN group in each layout and a
    zero one, the shipped pass's outputs at both scale modes (the candidates' reference), its bytes moved and its
    time under CUDA-graph replay, and the shape's result row (also the TMA sweep's)."""
    from jetrl.bench.timing import graph_time_us
    from jetrl.fp8.kernels.quant_triton import quantize_dual_triton

    torch.manual_seed(0)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16) * 3
    x[5, 7] = float("nan")
    x[300 % m, : min(k, 128)] = 0.0
    nbytes = x.numel() * 4 + (m * triton.cdiv(k, 128) + k * triton.cdiv(m, 128)) * 4
    refs = {p: quantize_dual_triton(x, p) for p in (False, True)}
    base_us = graph_time_us(partial(quantize_dual_triton, x, False), dev, calls=10, replays=20)
    print(f"{m}x{k}: shipped {base_us:.1f} us, {nbytes / base_us / 1e6:.2f} TB/s", flush=True)
    return x, refs, nbytes, base_us, {"shape": [m, k], "shipped_us": base_us, "shipped_tb_s": nbytes / base_us / 1e6,
                                      "candidates": []}


def candidate_row(name: str, run, x: torch.Tensor, refs: dict, nbytes: int, base_us: float) -> dict:
    """A candidate ``run(x, pow2)`` of the dual-layout pass checked bit for bit against ``refs[pow2]`` (the shipped
    pass's four outputs) at both scale modes, then timed under CUDA-graph replay against ``base_us`` (also the
    TMA sweep's, bench/sweep_quant_dual_tma.py)."""
    from jetrl.bench.checks import bit_equal
    from jetrl.bench.timing import graph_time_us

    equal = all(bit_equal(a, b) for p in (False, True) for a, b in zip(run(x, p), refs[p]))
    us = graph_time_us(partial(run, x, False), x.device, calls=10, replays=20)
    return {"name": name, "us": us, "tb_s": nbytes / us / 1e6, "bit_equal": equal, "vs_shipped": base_us / us}


def main() -> None:
    from jetrl.bench.report import guarded

    dev = torch.device("cuda")
    out = {"rows": []}
    for m, k in ((8192, 4096), (9216, 4096), (9216, 12288), (1000, 576)):
        x, refs, nbytes, base_us, row = shipped_baseline(m, k, dev)
        for spt_m, spt_k, bare in CANDIDATES:
            name = f"regs {spt_m}x{spt_k} bare={bare}"
            run = partial(dual_regs, spt_m=spt_m, bare=bare, spt_k=spt_k)
            cand = guarded(name, partial(candidate_row, name, run, x, refs, nbytes, base_us))
            row["candidates"].append(cand)
            print("  ", cand, flush=True)
        out["rows"].append(row)
    print("\nshape            shipped TB/s   candidates (TB/s, x shipped, bit-equal)")
    for row in out["rows"]:
        print(f"{row['shape']}  {row['shipped_tb_s']:.2f}   " + "; ".join(
            f"{c['name']} {c['tb_s']:.2f} {c['vs_shipped']:.2f}x {c['bit_equal']}" if "us" in c else
            f"{c['name']} ERROR" for c in row["candidates"]))
    with open(os.path.join(os.environ.get("OUT", "."), "sweep_quant_dual_regs.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    if os.environ.get("SASS_ONLY") == "1":
        sass_only()
    else:
        main()
