"""Why is bench (b)'s eager fwd+bwd of the o projection slower in FP8 than in BF16 on some hosts?

Its three FP8 GEMMs are ~1.4x BF16's and the activation quantization adds ~0.15 ms, yet runs CF-DO measured the
whole eager call at 0.91-1.06x. Two candidates: a host synchronization inside Float8Linear (the host could then not
run ahead of the GPU), or plain host time per call above the GPU's. This probe checks the first with
``torch.cuda.set_sync_debug_mode("error")`` over FP8 fwd+bwd calls, and measures the second: host ms per call
(``perf_counter`` over calls issued without waiting) against GPU ms per call (CUDA events over the same calls), for
BF16 and FP8, at the 8B layer's four shapes and bench (b)'s M. Each row also times the FP8 call with the activation
and gradient scales forced row-major (``fp8_rowmajor_*``): the layout before run DT, which made the GEMMs copy them
into cuBLAS's column-major layout first.

    PYTHONPATH=. OUT=$OUT python3 bench/probe_linear_host.py

``PROFILE=1`` adds cProfile over 20 FP8 fwd+bwd calls of the o projection (where the host time goes). ``GRIDS=1``
adds bench (b)'s measure itself (its timer: medians of 10 back-to-back calls) with the dual-layout quantizer's old
launch grid (128-wide chunks, 128-row pieces, 8 warps) and the new one (runs DM-DN), alternated old, new, new, old:
run DR asked whether the new grid made o slower (it did not).
"""

import contextlib
import cProfile
import json
import os
import pstats

import torch
from torch import nn

from jetrl.bench.kernels import fresh_fwd_bwd
from jetrl.bench.shapes import h200_config
from jetrl.bench.timing import host_and_device_ms, time_ms
from jetrl.fp8 import linear as linear_module
from jetrl.fp8.kernels import quant_triton
from jetrl.fp8.linear import Float8Linear
from jetrl.fp8.recipe import get_recipe

DEV, BF = torch.device("cuda"), torch.bfloat16
TOKENS, CALLS = 8192, 20
OLD_GRID = {"chunk": 128, "rows": 128, "num_warps": 8}  # quantize_dual_triton's launch grid before run DM


@contextlib.contextmanager
def forced(module, names: tuple[str, ...], **kwargs):
    """``module``'s functions ``names`` called with ``kwargs`` over the caller's own (restored on exit): the scales'
    layout before run DT (``col_major_scales=False`` in jetrl/fp8/linear.py), the quantizer's launch grid before DM."""
    saved = {n: getattr(module, n) for n in names}
    for n, fn in saved.items():
        setattr(module, n, lambda *args, fn=fn, **kw: fn(*args, **{**kw, **kwargs}))
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(module, n, fn)


def host_and_gpu_ms(run) -> tuple[float, float]:
    """(host, GPU) ms per call over CALLS calls issued back to back, after 3 warm-up calls."""
    for _ in range(3):
        run()
    return host_and_device_ms(run, DEV, calls=CALLS)


def grid_ratios(bf16_run, fp8_run) -> dict:
    """Bench (b)'s fwd+bwd ratio with the old and the new dual-layout grid, alternated old, new, new, old."""
    timer = {"device": DEV, "iters": 20, "warmup": 5, "back_to_back": 10}
    bf16_ms = time_ms(bf16_run, **timer)
    fp8_ms = {"old": [], "new": []}
    for label in ("old", "new", "new", "old"):
        with forced(quant_triton, ("quantize_dual_triton",), **(OLD_GRID if label == "old" else {})):
            fp8_ms[label].append(time_ms(fp8_run, **timer))
    return {f"ratio_{label}_grid": bf16_ms / (sum(ms) / 2) for label, ms in fp8_ms.items()}


def main() -> None:
    rows = []
    for name, k, n in h200_config().layer_gemms():
        torch.manual_seed(0)
        bf16 = nn.Linear(k, n, bias=False, device=DEV, dtype=BF)
        fp8 = Float8Linear.from_float(bf16, get_recipe("jet"), name=f"probe.{name}")
        x = torch.randn(TOKENS, k, device=DEV, dtype=BF, requires_grad=True)
        dy = torch.randn(TOKENS, n, device=DEV, dtype=BF)

        def fwd_bwd(mod, x=x, dy=dy):
            return fresh_fwd_bwd([mod], x, [dy])

        row = {"gemm": name, "k": k, "n": n}
        fwd_bwd(fp8)()  # the weight cache's first quantization checks finiteness (one sync, once per version)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                fwd_bwd(fp8)()
            row["fp8_syncs"] = "none"
        except RuntimeError as exc:
            row["fp8_syncs"] = str(exc).splitlines()[0][:200]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for label, mod in (("bf16", bf16), ("fp8", fp8)):
            row[f"{label}_host_ms"], row[f"{label}_gpu_ms"] = host_and_gpu_ms(fwd_bwd(mod))
        with forced(linear_module, ("quantize", "quantize_with_transpose"), col_major_scales=False):
            row["fp8_rowmajor_host_ms"], row["fp8_rowmajor_gpu_ms"] = host_and_gpu_ms(fwd_bwd(fp8))
        if os.environ.get("GRIDS"):
            row.update(grid_ratios(fwd_bwd(bf16), fwd_bwd(fp8)))
        rows.append(row)
        print(json.dumps(row), flush=True)
        if os.environ.get("PROFILE") and name == "o":
            step = fwd_bwd(fp8)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(CALLS):
                step()
            prof.disable()
            torch.cuda.synchronize()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
            pstats.Stats(prof).sort_stats("cumtime").print_stats(40)
    with open(os.path.join(os.environ.get("OUT", "."), "probe_linear_host.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"\n{'gemm':8} {'bf16 host/gpu ms':>18} {'fp8 host/gpu ms':>18} {'row-major host/gpu':>18}  fp8 syncs")
    for r in rows:
        print(f"{r['gemm']:8} {r['bf16_host_ms']:8.3f}/{r['bf16_gpu_ms']:<8.3f} {r['fp8_host_ms']:8.3f}/"
              f"{r['fp8_gpu_ms']:<8.3f} {r['fp8_rowmajor_host_ms']:8.3f}/{r['fp8_rowmajor_gpu_ms']:<8.3f}  "
              f"{r['fp8_syncs']}")


if __name__ == "__main__":
    main()
