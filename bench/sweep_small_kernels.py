"""Launch shapes of the decode step's elementwise kernels: SwiGLU and RMSNorm (a question for the H200).

At the rollout's B = 256 (docs/benchmarks.md (d), profile) a `jet_kv` layer spends ~8.8 µs in SwiGLU with its
FP8 epilogue (2.5 TB/s on ~22 MB) and ~4 µs per RMSNorm (2-4 MB): latency, not bytes. This times, under
CUDA-graph replay, the shipped launches against other tile widths and warp counts (the launchers' ``block`` /
``block_r`` / ``num_warps`` overrides), with and without the quantizing epilogue, and checks every variant's
output, codes and scales bit-equal to the shipped launch. GPU only:

    PYTHONPATH=. OUT=$OUT python3 bench/sweep_small_kernels.py

Result (run AR, docs/benchmarks.md (d)): SwiGLU's time does not depend on its launch shape; RMSNorm with 8-16 warps
per row saves ~0.3 µs a call, not worth changing the trainer's reduction tree for. The launches stay.
"""

import json
import os

import torch

from jetrl.bench.timing import graph_time_us
from jetrl.models.fused import QuantizedOutput
from jetrl.models.kernels import fused_triton as ft

DEV = torch.device("cuda")


def norm_launch(x, w, out, quant, block_r, warps, delta=None, h=None):
    """The shipped (add +) RMSNorm launch at another row tile and warp count, into ``out`` (and ``h``)."""
    ft._launch_rms_norm(x.view(-1, 1, x.shape[-1]), w, out, 1e-6, delta, h, quant, block_r=block_r, num_warps=warps)
    return out


def quant_buffers(rows, cols):
    return QuantizedOutput(torch.empty(rows, cols, device=DEV, dtype=torch.float8_e4m3fn),
                           torch.empty(rows, cols // 128, device=DEV, dtype=torch.float32), True)


def main() -> None:
    res = []
    torch.manual_seed(0)
    for m in [int(v) for v in os.environ.get("SWEEP_ROWS", "64,256").split(",")]:
        # SwiGLU over the stacked gate/up output (strided columns), I = 12288
        gu = torch.randn(m, 2 * 12288, device=DEV, dtype=torch.bfloat16)
        g, u = gu[:, :12288], gu[:, 12288:]
        for quant in (False, True):
            ref_q = quant_buffers(m, 12288) if quant else None
            ref = ft.silu_mul_triton(g, u, ref_q)  # the shipped launch
            for block, warps in [(1024, 4), (1024, 2), (2048, 4), (2048, 8), (4096, 8), (4096, 16), (512, 2),
                                 (512, 4)]:
                q = quant_buffers(m, 12288) if quant else None
                out = ft.silu_mul_triton(g, u, q, block=block, num_warps=warps)
                same = torch.equal(out, ref) and (not quant or (torch.equal(q.codes.view(torch.uint8),
                                                                            ref_q.codes.view(torch.uint8))
                                                                and torch.equal(q.scales, ref_q.scales)))
                us = graph_time_us(lambda b=block, w=warps, qq=q: ft.silu_mul_triton(g, u, qq, block=b, num_warps=w),
                                   DEV, calls=20, replays=20)
                res.append({"kernel": "silu_mul", "M": m, "quant": quant, "block": block, "warps": warps,
                            "us": us, "bit_equal": same})
        # RMSNorm and add + RMSNorm, hidden 4096
        x = torch.randn(m, 4096, device=DEV, dtype=torch.bfloat16)
        d = torch.randn(m, 4096, device=DEV, dtype=torch.bfloat16)
        w = torch.randn(4096, device=DEV, dtype=torch.bfloat16)
        for add in (False, True):
            for quant in (False, True):
                ref_q = quant_buffers(m, 4096) if quant else None
                ref_h = torch.empty_like(x) if add else None
                ref = norm_launch(x, w, torch.empty_like(x), ref_q, 1, 4, d if add else None, ref_h)
                for block_r, warps in [(1, 4), (1, 8), (1, 16), (1, 2), (2, 8), (4, 16)]:
                    q = quant_buffers(m, 4096) if quant else None
                    h = torch.empty_like(x) if add else None
                    out = torch.empty_like(x)
                    norm_launch(x, w, out, q, block_r, warps, d if add else None, h)
                    same = torch.equal(out, ref) and (not add or torch.equal(h, ref_h)) and (
                        not quant or (torch.equal(q.codes.view(torch.uint8), ref_q.codes.view(torch.uint8))
                                      and torch.equal(q.scales, ref_q.scales)))
                    us = graph_time_us(lambda br=block_r, wp=warps, o=out, qq=q, hh=h, a=add:
                                       norm_launch(x, w, o, qq, br, wp, d if a else None, hh),
                                       DEV, calls=20, replays=20)
                    res.append({"kernel": "add_rms_norm" if add else "rms_norm", "M": m, "quant": quant,
                                "block_r": block_r, "warps": warps, "us": us, "bit_equal": same})
    with open(os.path.join(os.environ.get("OUT", "."), "sweep_small_kernels.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"\n{'kernel':14} {'M':>4} {'quant':>5} {'tile':>6} {'warps':>5} {'us':>7}  bit-equal to shipped")
    for r in res:
        tile = r.get("block", r.get("block_r"))
        print(f"{r['kernel']:14} {r['M']:4d} {r['quant']!s:>5} {tile:6d} {r['warps']:5d} {r['us']:7.2f}  "
              f"{r['bit_equal']}")


if __name__ == "__main__":
    main()
