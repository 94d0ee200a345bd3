"""W^T of the FP8 weight codes: PyTorch's strided copy against the tiled Triton transpose (H200).

Checks the kernel bit for bit against ``codes.t().contiguous()`` at the 8B layer shapes, then times
both ways of refreshing the cache's W^T in place (what jetrl/fp8/weight_cache.py does for every FP8
weight after each optimizer step), and the whole model's worth (36 layers).

    PYTHONPATH=. OUT=$OUT python3 bench/time_code_transpose.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from jetrl.fp8.kernels.transpose_triton import transpose_triton

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


def time_ms(fn, reps: int = 20) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    rows, total = [], {"copy": 0.0, "triton": 0.0}
    for name, (n, k) in SHAPES.items():
        codes = (torch.randn(n, k, device="cuda") * 50).to(torch.float8_e4m3fn)
        out = torch.empty(k, n, dtype=codes.dtype, device="cuda")
        want = codes.t().contiguous()
        assert torch.equal(transpose_triton(codes, out).view(torch.uint8), want.view(torch.uint8)), name
        copy = time_ms(lambda c=codes, o=out: o.copy_(c.t()))
        tri = time_ms(lambda c=codes, o=out: transpose_triton(c, o))
        gbs = 2 * n * k / 1e9
        rows.append({"name": name, "shape": [n, k], "copy_ms": copy, "triton_ms": tri,
                     "copy_TBs": gbs / copy, "triton_TBs": gbs / tri})
        total["copy"] += 36 * copy
        total["triton"] += 36 * tri
        print(f"{name:8s} {n}x{k}: copy_ {copy:.3f} ms ({gbs / copy:.2f} TB/s), triton {tri:.3f} ms "
              f"({gbs / tri:.2f} TB/s), bit-equal", flush=True)
    print(f"36 layers: copy_ {total['copy']:.1f} ms, triton {total['triton']:.1f} ms per optimizer step")
    out_dir = Path(os.environ.get("OUT", "."))
    (out_dir / "code_transpose.json").write_text(json.dumps({"rows": rows, "per_step_36_layers_ms": total,
                                                             "torch": torch.__version__}, indent=1))


if __name__ == "__main__":
    main()
