"""Where does an eager Float8Linear fwd+bwd spend its ~1 ms of host time (bench (b), runs DS-DV)?

Each piece of the call is issued ``CALLS`` times back to back without waiting, and the host's time per call is
reported next to the device's (:func:`jetrl.bench.timing.host_and_device_ms`). At 1024 tokens the GPU work of
every piece is short, so the host's figure is its own cost, not back-pressure from a full launch queue. The
pieces, outermost first: the whole layer (fwd+bwd, fwd with autograd, fwd without), the autograd Function with
an empty body, the GEMM dispatch (``fp8_gemm``), jetrl's ``_scaled_mm`` wrapper, ``F.scaled_mm`` and the op under
it (``torch._scaled_mm_v2``) on ready operands, the quantizers (public and the raw Triton launch), the weight
cache's hit, and a BF16 ``torch.mm`` and ``nn.Linear`` fwd+bwd as the yardstick. Then ``torch.profiler``'s
self CPU time per op over 10 FP8 fwd+bwd calls, and cProfile's top Python functions.

    PYTHONPATH=. OUT=$OUT python3 bench/probe_host_parts.py

On CPU it runs the pieces that exist there (smoke only: CPU host times mean nothing for the GPU).
"""

import collections
import cProfile
import json
import os
import pstats
import time

import torch
import torch.nn.functional as F
from torch import nn

from jetrl.bench.kernels import fresh_fwd_bwd
from jetrl.bench.timing import host_and_device_ms
from jetrl.fp8 import gemm as gemm_module
from jetrl.fp8.gemm import fp8_gemm
from jetrl.fp8.linear import Float8Linear, clear_shared_input
from jetrl.fp8.projection_group import ProjectionGroup
from jetrl.fp8.quant import quantize, quantize_with_transpose
from jetrl.fp8.recipe import get_recipe

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BF = torch.bfloat16
TOKENS, K, N = int(os.environ.get("TOKENS", "1024")), 4096, 4096
CALLS = int(os.environ.get("CALLS", "50"))


class _Empty(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def siblings(x: torch.Tensor, dy_width: int) -> dict:
    """q/k/v of an 8B layer (4096 -> 4096, 1024, 1024) fwd+bwd: BF16 ``nn.Linear``s, the FP8 members one by one, and
    the FP8 members as one stacked Function (projection_group.py; what a CUDA training step runs)."""
    torch.manual_seed(0)
    sizes = (dy_width, dy_width // 4, dy_width // 4)
    bf16 = [nn.Linear(K, n, bias=False, device=DEV, dtype=BF) for n in sizes]
    separate, stacked = ([Float8Linear.from_float(linear, get_recipe("jet"), name=f"probe.{s}_proj")
                          for linear, s in zip(bf16, "qkv")] for _ in range(2))  # the BF16 weights, shared
    group = ProjectionGroup(stacked)
    for m in stacked:
        m.projection_group = group
    dys = [torch.randn(x.shape[0], n, device=DEV, dtype=BF) for n in sizes]
    out = {"bf16 q/k/v nn.Linear fwd+bwd": fresh_fwd_bwd(bf16, x, dys),
           "fp8 q/k/v separate fwd+bwd": fresh_fwd_bwd(separate, x, dys)}
    if DEV.type == "cuda":
        out["fp8 q/k/v one stacked Function fwd+bwd"] = fresh_fwd_bwd(stacked, x, dys)
    return out


def pieces() -> dict:
    torch.manual_seed(0)
    bf16 = nn.Linear(K, N, bias=False, device=DEV, dtype=BF)
    fp8 = Float8Linear.from_float(nn.Linear(K, N, bias=False, device=DEV, dtype=BF), get_recipe("jet"), name="probe")
    spec = fp8.precision()
    x = torch.randn(TOKENS, K, device=DEV, dtype=BF, requires_grad=True)
    dy = torch.randn(TOKENS, N, device=DEV, dtype=BF)
    xd = x.detach()
    cm = DEV.type == "cuda"
    x_q = quantize(xd, (1, 128), col_major_scales=cm)
    w_q = fp8.weight_cache.get(fp8.weight, spec.weight)
    xt_q = quantize(xd.t(), (1, 128), col_major_scales=cm)
    dyt_q = quantize(dy.t(), (1, 128), col_major_scales=cm)
    tiny = torch.randn(8, 8, device=DEV, requires_grad=True)

    def fwd_bwd(mod):
        return fresh_fwd_bwd([mod], x, [dy])

    def fwd(mod):
        def run():
            clear_shared_input()
            mod(x)
        return run

    def fwd_no_grad():
        clear_shared_input()
        with torch.no_grad():
            fp8(x)

    out = {
        **siblings(x, dy_width=N),
        "bf16 nn.Linear fwd+bwd": fwd_bwd(bf16),
        "fp8 Float8Linear fwd+bwd": fwd_bwd(fp8),
        "bf16 nn.Linear fwd (autograd on)": fwd(bf16),
        "fp8 Float8Linear fwd (autograd on)": fwd(fp8),
        "fp8 Float8Linear fwd (no_grad)": fwd_no_grad,
        "empty autograd.Function fwd+bwd": lambda: _Empty.apply(tiny).sum().backward(),
        "bf16 torch.mm": lambda: torch.mm(xd, bf16.weight.t()),
        "fp8_gemm fprop (dispatch + wrapper)": lambda: fp8_gemm(x_q, w_q, BF),
        "fp8_gemm wgrad (1x128 x 1x128)": lambda: fp8_gemm(dyt_q, xt_q, BF, batch_invariant=False),
        "quantize 1x128 (public)": lambda: quantize(xd, (1, 128), col_major_scales=cm),
        "quantize_with_transpose (public)": lambda: quantize_with_transpose(xd, col_major_scales=cm),
        "weight cache hit (get)": lambda: fp8.weight_cache.get(fp8.weight, spec.weight),
        "weight cache hit (get_transposed)": lambda: fp8.weight_cache.get_transposed(fp8.weight, spec.weight),
        f"torch.empty ({TOKENS} x {K} fp8)": lambda: torch.empty((TOKENS, K), dtype=torch.float8_e4m3fn, device=DEV),
    }
    if gemm_module.has_block_scaled_mm(DEV):
        from jetrl.fp8.kernels.quant_triton import _quantize_dual_kernel, quantize_dual_triton, quantize_triton

        a_codes, b_codes = x_q.codes, w_q.codes
        scale_a, scale_b = x_q.scales, gemm_module._pad(w_q.scales, 1, 4).t()
        st = F.ScalingType
        out["jetrl _scaled_mm wrapper"] = lambda: gemm_module._scaled_mm(x_q, w_q, BF)
        out["F.scaled_mm (ready operands)"] = lambda: F.scaled_mm(
            a_codes, b_codes.t(), scale_a, st.BlockWise1x128, scale_b, st.BlockWise128x128, output_dtype=BF)
        out["torch._scaled_mm_v2 (ready operands)"] = lambda: torch._scaled_mm_v2(
            a_codes, b_codes.t(), [scale_a], [st.BlockWise1x128.value], [], [scale_b], [st.BlockWise128x128.value], [],
            None, BF, [], False)
        out["quantize_triton (raw launcher)"] = lambda: quantize_triton(xd, 1, 128, False, col_major_scales=True)
        out["quantize_dual_triton (raw launcher)"] = lambda: quantize_dual_triton(xd, False, col_major_scales=True)
        codes, scales, codes_t, scales_t = quantize_dual_triton(xd, False, col_major_scales=True)
        args = (xd, codes.view(torch.uint8), scales, codes_t.view(torch.uint8), scales_t, TOKENS, K, *xd.stride(), K,
                *scales.stride(), *scales_t.stride(), 0)
        kw = {"POW2": False, "EXPLICIT_ROUND": False, "CHUNK": 32, "ROWS": 64, "num_warps": 4}
        grid = (K // 128, TOKENS // 128)
        out["dual kernel: JITFunction[grid](...)"] = lambda: _quantize_dual_kernel[grid](*args, **kw)
        try:  # the launch Triton's JIT front end does after binding the arguments (the constexprs too, in order)
            compiled = _quantize_dual_kernel.warmup(*args, grid=grid, **kw)
            flat = (*args, False, False, 32, 64)
            out["dual kernel: CompiledKernel[grid](...)"] = lambda: compiled[(*grid, 1)](*flat)
        except TypeError as exc:  # code whose kernel takes other arguments (an older tree, for an A/B)
            print(f"dual kernel: no CompiledKernel piece ({exc})")
    return out


def attribute(calls: int = 50) -> dict:
    """Host µs per FP8 fwd+bwd spent inside each of the layer's Python functions (inclusive), timed in whichever
    thread runs them: cProfile sees only the main thread, and autograd runs a CUDA backward in its device thread."""
    from jetrl.fp8 import linear as lin
    from jetrl.fp8.input_memo import InputMemo
    from jetrl.fp8.weight_cache import WeightCache

    spent: dict[str, float] = collections.defaultdict(float)

    def timed(label, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter() - t0
        return wrapper

    targets = [(lin, "_quantize_both", False), (lin, "_quantize", False), (lin, "fp8_gemm", False),
               (WeightCache, "get", False), (WeightCache, "get_transposed", False), (InputMemo, "get", False),
               (lin.Float8Linear, "forward", False), (lin._Float8LinearFn, "forward", True),
               (lin._Float8LinearFn, "backward", True)]
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in targets]
    for owner, name, static in targets:
        fn = getattr(owner, name)
        label = f"{getattr(owner, '__name__', owner)}.{name}"
        setattr(owner, name, staticmethod(timed(label, fn)) if static else timed(label, fn))
    try:
        torch.manual_seed(0)
        fp8 = Float8Linear.from_float(nn.Linear(K, N, bias=False, device=DEV, dtype=BF), get_recipe("jet"),
                                      name="probe")
        x = torch.randn(TOKENS, K, device=DEV, dtype=BF, requires_grad=True)
        dy = torch.randn(TOKENS, N, device=DEV, dtype=BF)
        for i in range(3 + calls):
            if i == 3:
                spent.clear()
            clear_shared_input()
            fp8.weight.grad = x.grad = None
            t0 = time.perf_counter()
            y = fp8(x)
            t1 = time.perf_counter()
            y.backward(dy)
            t2 = time.perf_counter()
            spent["main: module call"] += t1 - t0
            spent["main: .backward()"] += t2 - t1
        if DEV.type == "cuda":
            torch.cuda.synchronize()
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
    return {label: s * 1e6 / calls for label, s in sorted(spent.items())}


def main() -> None:
    rows = []
    for label, us in attribute().items():
        print(f"  {label:44} {us:8.1f} us per fwd+bwd (inclusive)", flush=True)
    for name, run in pieces().items():
        for _ in range(3):
            try:
                run()
            except Exception as exc:  # noqa: BLE001 -- a probe row that cannot run says why and the rest go on
                print(f"{name}: {type(exc).__name__}: {exc}")
                break
        else:
            host, device = host_and_device_ms(run, DEV, calls=CALLS)
            rows.append({"piece": name, "host_us": host * 1e3, "device_us": device * 1e3})
            print(json.dumps(rows[-1]), flush=True)
    step = pieces()["fp8 Float8Linear fwd+bwd"]
    for _ in range(3):
        step()
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(10):
            step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(20):
        step()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(30)
    with open(os.path.join(os.environ.get("OUT", "."), "probe_host_parts.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"\n{'piece':42} {'host us':>9} {'device us':>10}   ({TOKENS} x {K} -> {N}, {DEV})")
    for r in rows:
        print(f"{r['piece']:42} {r['host_us']:9.1f} {r['device_us']:10.1f}")


if __name__ == "__main__":
    main()
