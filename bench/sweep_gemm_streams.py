"""Split-K over concurrent streams for the decode GEMMs at M = 128-256 (a question for the H200).

At the rollout's M = 256, cuBLAS's block-FP8 GEMM tiles the output in 128 x 128: qkv (N = 6144)
is 96 CTAs, o and down (N = 4096) 64 -- under half of the 132 SMs -- and each CTA walks all of K.
This times, under CUDA-graph replay, each GEMM of one 8B layer as shipped against the same GEMM
split into S parts along K, run as S cuBLAS calls on S streams (fp32 partial outputs, summed and
rounded to bf16 afterwards), and the same split on one stream; every variant is checked against the
shipped GEMM. Weights rotate over copies (> 3x the L2), as in bench (c). GPU only:

    PYTHONPATH=. OUT=$OUT python3 bench/sweep_gemm_streams.py
"""

import json
import os

import torch

from jetrl.bench.kernels import rotating_weights, taking_turns
from jetrl.bench.shapes import h200_config
from jetrl.bench.timing import graph_time_us
from jetrl.fp8.gemm import _scaled_mm
from jetrl.fp8.quant import BLOCK, Float8Blocks, quantize

DEV = torch.device("cuda")


def k_parts(blocks: Float8Blocks, parts: int) -> list[Float8Blocks]:
    """``blocks`` cut into ``parts`` contiguous pieces along K (whole 128-groups each)."""
    k = blocks.codes.shape[1]
    step = k // parts
    return [Float8Blocks(blocks.codes[:, i * step:(i + 1) * step].contiguous(),
                         blocks.scales[:, i * step // BLOCK:(i + 1) * step // BLOCK].contiguous(), blocks.block)
            for i in range(parts)]


def a_parts(a: Float8Blocks, parts: int) -> list[Float8Blocks]:
    """The activation's K pieces as views (column-major scales stay column-major)."""
    k = a.codes.shape[1]
    step = k // parts
    return [Float8Blocks(a.codes[:, i * step:(i + 1) * step], a.scales[:, i * step // BLOCK:(i + 1) * step // BLOCK],
                         a.block) for i in range(parts)]


def split_gemm(a_pieces, w_pieces, streams, concurrent: bool) -> torch.Tensor:
    cur = torch.cuda.current_stream()
    outs = []
    if concurrent:
        for s in streams[1:len(a_pieces)]:
            s.wait_stream(cur)
    for i, (a, w) in enumerate(zip(a_pieces, w_pieces)):
        stream = streams[i] if concurrent and i else cur
        with torch.cuda.stream(stream):
            outs.append(_scaled_mm(a, w, torch.float32))
    if concurrent:
        for s in streams[1:len(a_pieces)]:
            cur.wait_stream(s)
    total = outs[0]
    for o in outs[1:]:
        total = total + o
    return total.to(torch.bfloat16)


def main() -> None:
    cfg = h200_config()
    rows = [int(m) for m in os.environ.get("SWEEP_ROWS", "128,256").split(",")]
    splits = [int(s) for s in os.environ.get("SWEEP_SPLITS", "2,3,4").split(",")]
    streams = [torch.cuda.current_stream()] + [torch.cuda.Stream() for _ in range(max(splits) - 1)]
    results = []
    torch.manual_seed(0)
    for name, k, n in cfg.layer_gemms():
        weights, bf16_w = rotating_weights(n, k, DEV)
        copies = len(weights)
        for m in rows:
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            a = quantize(x, (1, BLOCK), col_major_scales=True)
            ref = _scaled_mm(a, weights[0], torch.bfloat16).float()

            row = {"gemm": name, "M": m, "N": n, "K": k}
            row["bf16_us"] = graph_time_us(taking_turns(lambda w: x @ w.t(), bf16_w), DEV, calls=len(bf16_w), replays=20)
            row["cublas_us"] = graph_time_us(taking_turns(lambda w: _scaled_mm(a, w, torch.bfloat16), weights), DEV,
                                             calls=copies, replays=20)
            for s in splits:
                if (k // BLOCK) % s:
                    continue
                pieces = [k_parts(w, s) for w in weights]
                a_p = a_parts(a, s)
                try:
                    _scaled_mm(a_p[1], pieces[0][1], torch.float32)
                    row["a_pieces"] = "views"
                except RuntimeError as exc:  # cuBLAS via torch may want contiguous rows: copy (not timed)
                    row["a_pieces"] = f"copies ({str(exc).splitlines()[0][:80]})"
                    a_p = [Float8Blocks(p.codes.contiguous(), p.scales, p.block) for p in a_p]
                err = float((split_gemm(a_p, pieces[0], streams, True).float() - ref).norm() / ref.norm())
                for concurrent in (True, False):
                    key = f"split{s}_{'streams' if concurrent else 'serial'}_us"
                    row[key] = graph_time_us(taking_turns(lambda p, c=concurrent: split_gemm(a_p, p, streams, c), pieces),
                                             DEV, calls=copies, replays=20)
                row[f"split{s}_rel_err"] = err
            results.append(row)
            print(row, flush=True)
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "sweep_gemm_streams.json"), "w") as f:
        json.dump(results, f, indent=1)
    head = " ".join(f"s{s} streams/serial".rjust(18) for s in splits)
    print(f"\n{'gemm':8} {'M':>4} {'bf16':>7} {'cublas':>7} {head}")
    for r in results:
        nan = float("nan")
        cells = " ".join(f"{r.get(f'split{s}_streams_us', nan):8.1f}/{r.get(f'split{s}_serial_us', nan):<8.1f}"
                         .rjust(18) for s in splits)
        print(f"{r['gemm']:8} {r['M']:4d} {r['bf16_us']:7.1f} {r['cublas_us']:7.1f} {cells}")


if __name__ == "__main__":
    main()
