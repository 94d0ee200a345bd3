"""Sections (a)-(c): the FP8 quantizers, Float8Linear, and the decode GEMMs, each checked then timed.

(a) ``quant_kernels``: effective bandwidth of each quantizer, (bytes read + bytes written) /
    time, against the copy ceiling ``y.copy_(x)`` measured on a same-size BF16 tensor in the
    same run. Inputs: a (tokens, hidden) BF16 activation in 1x128 groups, the same tensor in the
    wgrad layout ``quantize(x.t())``, the fused dual-layout pass ``quantize_with_transpose``,
    a (intermediate, hidden) weight in 128x128 blocks, and K/V in per-token-head groups
    (``quantize_kv``; a prefill's worth event-timed, a decode step's worth under CUDA-graph
    replay). Correctness: codes and scales bit-equal to ``quantize_reference`` on the same
    device tensor, plus edge cases (NaN groups, power-of-two scales, K = 576, fp32 input)
    against the CPU reference. Target: >= 2.5 TB/s.
(b) ``float8_linear``: Float8Linear (recipe ``jet``) forward (no grad) and forward+backward
    against BF16 ``nn.Linear`` at the four GEMMs of a Qwen3-8B layer, M tokens, quantization
    included (the weight is quantized once per version, as in training). Correctness: SQNR of
    y, dx, dw against an fp32 ``nn.Linear`` with the same weights, and the fprop / dgrad /
    wgrad operand layouts of the dispatched FP8 GEMM against the emulation. Also recorded:
    the three FP8 GEMMs alone, pre-quantized (what the quantization costs on top). Target 1.45x.
    Optional second baseline (``--torchao``): torchao's blockwise FP8 training linear, the same
    recipe (``torchao_baseline.py``), SQNR-checked and timed the same way.
(c) ``decode_gemms``: the same four GEMMs at decode rows M, under CUDA-graph replay
    (``graph_calls`` back-to-back calls per graph): BF16 ``F.linear``; each FP8 GEMM backend
    on pre-quantized operands; and "fp8" = a Float8Linear in the rollout phase (activation
    quantization + the dispatcher's per-shape pick), which is what a decode step pays.
    Correctness: every FP8 output within 1e-2 relative Frobenius error of ``gemm_emulated``.
    The FP8 weight-bytes floor (N*K code bytes + scales at the copy ceiling) is listed.
    Target: the sum over the four GEMMs >= 1.8x BF16 at each M <= 64. Last rows: the five input
    projections (q, k, v, gate, up) as five GEMMs against two stacked ones, in BF16 and FP8 -- what
    the FP8 projection groups save, and what stacking would save BF16 (:func:`_stacking_row`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from jetrl.bench.checks import GEMM_REL_ERR_MAX, LINEAR_SQNR_MIN_DB, bit_equal, rel_err, sqnr_db, status
from jetrl.bench.report import error_row, guarded, set_target
from jetrl.bench.shapes import BenchConfig
from jetrl.bench.timing import HBM_BYTES_PER_S, graph_time_us, host_and_device_ms, tb_per_s, time_ms
from jetrl.bench.torchao_baseline import OFF as TORCHAO_OFF
from jetrl.bench.torchao_baseline import torchao_fields
from jetrl.fp8 import Float8Blocks, Float8Linear, fp8_gemm, gemm_emulated, get_recipe, override_backend, quantize
from jetrl.fp8 import gemm as gemm_module
from jetrl.fp8 import quant as quant_module
from jetrl.fp8.linear import clear_shared_input
from jetrl.fp8.recipe import precision_phase

QUANT_TARGET_TB_S = 2.5
LINEAR_TARGET = 1.45
DECODE_SUM_TARGET, DECODE_SUM_MAX_M = 1.8, 64


# ------------------------------------------------------------------------------------------ (a)
def _quant_bytes(src: torch.Tensor, outs: tuple[Float8Blocks, ...]) -> int:
    return src.numel() * src.element_size() + sum(o.codes.nbytes + o.scales.nbytes for o in outs)


def _matches_reference(outs: tuple[Float8Blocks, ...], refs: list[tuple[torch.Tensor, int, int]], pow2: bool) -> bool:
    for out, (src, br, bc) in zip(outs, refs, strict=True):
        codes, scales = quant_module.quantize_reference(src, br, bc, pow2)
        if not (bit_equal(out.codes, codes) and bit_equal(out.scales.reshape(scales.shape), scales)):
            return False
    return True


def _quant_kv(x: torch.Tensor) -> Float8Blocks:
    from jetrl.fp8.kv_quant import quantize_kv

    return quantize_kv(x)


def quant_kernels(cfg: BenchConfig, device: torch.device) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    bf16 = torch.bfloat16
    x = torch.randn(cfg.act_shape, device=device, dtype=bf16)
    w = torch.randn(cfg.weight_shape, device=device, dtype=bf16) * 0.02
    kv_prefill = torch.randn(cfg.kv_prefill_tokens, cfg.kv_heads, cfg.head_dim, device=device, dtype=bf16)
    kv_decode = torch.randn(cfg.kv_decode_rows, cfg.kv_heads, cfg.head_dim, device=device, dtype=bf16)
    hd = cfg.head_dim
    m, k = cfg.act_shape
    # name, source, fn -> Float8Blocks or a tuple, reference (tensor, br, bc) per output, decode-sized (no target)
    cases: list[tuple[str, torch.Tensor, Any, list, bool]] = [
        (f"quant 1x128 act {m}x{k}", x, lambda: quantize(x), [(x, 1, 128)], False),
        ("quant 1x128 wgrad layout x.t()", x, lambda: quantize(x.t()), [(x.t(), 1, 128)], False),
        (f"quant fused x + x.t() {m}x{k}", x, lambda: quant_module.quantize_with_transpose(x),
         [(x, 1, 128), (x.t(), 1, 128)], False),
        (f"quant 128x128 weight {cfg.weight_shape[0]}x{cfg.weight_shape[1]}", w, lambda: quantize(w, (128, 128)),
         [(w, 128, 128)], False),
        (f"quant KV token-head prefill {cfg.kv_prefill_tokens}x{cfg.kv_heads}", kv_prefill,
         lambda: _quant_kv(kv_prefill), [(kv_prefill.reshape(-1, hd), 1, hd)], False),
        (f"quant KV token-head decode {cfg.kv_decode_rows}x{cfg.kv_heads}", kv_decode,
         lambda: _quant_kv(kv_decode), [(kv_decode.reshape(-1, hd), 1, hd)], True),
    ]
    ceilings: dict[int, float] = {}
    rows = []
    for name, src, fn, refs, graphed in cases:
        try:
            out = fn()
            outs = out if isinstance(out, tuple) else (out,)
            ok = _matches_reference(outs, refs, pow2=False)
            nbytes = _quant_bytes(src, outs)
            # The kernel's speed (the target's subject): CUDA-graph replay, no host work in the timing.
            # Large tensors also get the eager figure (public quantize(), 10 calls back to back), which
            # includes the per-call host work (validation, Triton's launcher) when it is not hidden.
            ms = graph_time_us(fn, device, calls=cfg.graph_calls, replays=cfg.graph_replays) * 1e-3
            key = src.numel()
            if key not in ceilings:
                ceilings[key] = _copy_ceiling(src, device, cfg)
            value = tb_per_s(nbytes, ms)
            row = {"name": name, "unit": "TB/s", "baseline": ceilings[key], "baseline_label": "copy",
                   "value": value, "ratio": value / ceilings[key], "ms": ms, "bytes": nbytes,
                   "check": status(ok), "check_detail": "codes+scales bit-equal" if ok else "codes/scales differ",
                   "note": "CUDA graph; ratio = fraction of the copy ceiling"}
            if not graphed:
                eager_ms = time_ms(fn, device, iters=cfg.iters, warmup=cfg.warmup, back_to_back=cfg.back_to_back)
                row["eager_tb_s"] = tb_per_s(nbytes, eager_ms)
                row["note"] += f"; eager back to back {row['eager_tb_s']:.2f} TB/s"
                set_target(row, ">=", QUANT_TARGET_TB_S, key="value", unit="TB/s", smoke=cfg.smoke)
            rows.append(row)
        except Exception as exc:  # noqa: BLE001 -- one kernel failing must not hide the others
            rows.append(error_row(name, exc))
    rows.append(guarded("quant edge cases vs CPU reference", partial(_quant_edge_cases, device)))
    return rows


def _copy_ceiling(src: torch.Tensor, device: torch.device, cfg: BenchConfig) -> float:
    """TB/s of ``b.copy_(a)`` on a bf16 tensor of ``src``'s size, timed like the kernels (CUDA graph)."""
    a = torch.randn(src.numel(), device=device).to(torch.bfloat16)
    b = torch.empty_like(a)
    us = graph_time_us(lambda: b.copy_(a), device, calls=cfg.graph_calls, replays=cfg.graph_replays)
    return tb_per_s(2 * a.nbytes, us * 1e-3)


def _quant_edge_cases(device: torch.device) -> dict[str, Any]:
    """NaN groups, pow2 scales, a partial group (K = 576), fp32 input: device result vs the CPU reference."""
    gen = torch.Generator().manual_seed(1)
    cases = [((300, 576), torch.float32, (1, 128)), ((130, 384), torch.bfloat16, (1, 128)),
             ((200, 576), torch.float32, (128, 128)), ((256, 384), torch.bfloat16, (128, 128))]
    bad = []
    for shape, dtype, block in cases:
        for pow2 in (False, True):
            x = (torch.randn(shape, generator=gen) * torch.exp(2 * torch.randn(shape, generator=gen))).to(dtype)
            x[0, 3] = float("nan")
            ref_codes, ref_scales = quant_module.quantize_reference(x, *block, pow2)
            got = quantize(x.to(device), block, pow2_scale=pow2)
            if not (bit_equal(got.codes.cpu(), ref_codes) and bit_equal(got.scales.cpu(), ref_scales)):
                bad.append(f"{shape} {dtype} {block} pow2={pow2}")
            if block == (1, 128):
                pair = quant_module.quantize_with_transpose(x.to(device), pow2_scale=pow2)
                t_codes, t_scales = quant_module.quantize_reference(x.t(), 1, 128, pow2)
                if not (bit_equal(pair[0].codes.cpu(), ref_codes) and bit_equal(pair[0].scales.cpu(), ref_scales)
                        and bit_equal(pair[1].codes.cpu(), t_codes) and bit_equal(pair[1].scales.cpu(), t_scales)):
                    bad.append(f"fused {shape} {dtype} pow2={pow2}")
    return {"name": "quant edge cases vs CPU reference", "check": status(not bad),
            "check_detail": "NaN, pow2, K=576, fp32: bit-equal" if not bad else "; ".join(bad)[:300],
            "cases": len(cases) * 2}


# ------------------------------------------------------------------------------------------ (b)
def float8_linear(cfg: BenchConfig, device: torch.device) -> list[dict[str, Any]]:
    rows = [guarded("FP8 GEMM fprop/dgrad/wgrad vs emulated", partial(_gemm_layouts, cfg, device))]
    for name, k, n in cfg.layer_gemms():
        try:
            rows += _linear_rows(cfg, device, name, cfg.linear_tokens, k, n)
        except Exception as exc:  # noqa: BLE001 -- recorded in the row; the other shapes still run
            rows.append(error_row(f"Float8Linear {name} {k}x{n}", exc))
    return rows


def fresh_fwd_bwd(modules: list[nn.Module], x: torch.Tensor, grads: list[torch.Tensor]):
    """A call that runs ``modules`` on ``x`` (which requires grad) and backpropagates ``grads`` into their outputs, as a
    training step pays it: the held sibling quantization of ``x`` forgotten first (a fresh activation's cost, though
    the same ``x`` comes back every call) and the gradients reset, so calls neither reuse nor accumulate."""

    def run() -> None:
        clear_shared_input()
        for m in modules:
            m.weight.grad = None
        x.grad = None
        torch.autograd.backward([m(x) for m in modules], grads)
    return run


def _linear_rows(cfg: BenchConfig, device: torch.device, name: str, m: int, k: int, n: int) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    recipe = get_recipe("jet")
    ref32 = nn.Linear(k, n, bias=False, device=device)
    bf16 = nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        bf16.weight.copy_(ref32.weight)
        ref32.weight.copy_(bf16.weight)  # the reference sees the same (BF16-representable) weights
    fp8 = Float8Linear.from_float(bf16, recipe, name=f"bench.{name}")
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    dy = torch.randn(m, n, device=device, dtype=torch.bfloat16)

    x32 = x.float().requires_grad_()
    y32 = ref32(x32)
    y32.backward(dy.float())
    xf = x.clone().requires_grad_()
    y8 = fp8(xf)
    y8.backward(dy)
    sqnr = {"y": sqnr_db(y8, y32), "dx": sqnr_db(xf.grad, x32.grad), "dw": sqnr_db(fp8.weight.grad, ref32.weight.grad)}
    fp8.weight.grad = None
    timer = {"device": device, "iters": cfg.iters, "warmup": cfg.warmup, "back_to_back": cfg.back_to_back}
    ao = (torchao_fields(bf16, x, dy, {"y": y32, "dx": x32.grad, "dw": ref32.weight.grad}, timer) if cfg.torchao
          else {"torchao": TORCHAO_OFF})
    del x32, y32, xf, y8, ref32

    xg = x.clone().requires_grad_()

    # Every timed call is fed the same x, and Float8Linear keeps the last input's quantization for sibling layers
    # (input_memo.py): it is forgotten before each call, so every call pays the quantization a fresh activation
    # does in training (without this the FP8 rows skipped x's quantization: runs before CF).
    def fwd_bwd(mod: nn.Module):
        return fresh_fwd_bwd([mod], xg, [dy])

    def fwd(mod: nn.Module):
        def run() -> torch.Tensor:
            clear_shared_input()
            return mod(x)
        return run

    with torch.no_grad():
        fwd_bf16, fwd_fp8 = time_ms(fwd(bf16), **timer), time_ms(fwd(fp8), **timer)
    fb_bf16, fb_fp8 = time_ms(fwd_bwd(bf16), **timer), time_ms(fwd_bwd(fp8), **timer)
    # the host's time per eager call: where the FP8 call's is about its fwd+bwd time, the GPU waited on the host
    host_bf16, host_fp8 = (host_and_device_ms(fwd_bwd(mod), device, calls=cfg.back_to_back)[0] for mod in (bf16, fp8))
    # the three FP8 GEMMs on pre-quantized operands, against the three BF16 GEMMs
    wq = fp8.weight_cache.get(fp8.weight, recipe.train.weight)
    xq, dyq, dytq, xtq, wtq = quantize(x), quantize(dy), quantize(dy.t()), quantize(x.t()), wq.t()
    gemms_fp8 = time_ms(lambda: (fp8_gemm(xq, wq), fp8_gemm(dyq, wtq, batch_invariant=False),  # as linear.py calls
                                 fp8_gemm(dytq, xtq, torch.float32, batch_invariant=False)), **timer)
    w = bf16.weight.detach()
    gemms_bf16 = time_ms(lambda: (x @ w.t(), dy @ w, dy.t() @ x), **timer)
    # the activation quantization a layer pays per fwd+bwd: x and dy, each in both layouts
    dual = quant_module.quantize_with_transpose
    act_quant = time_ms(lambda: (dual(x), dual(dy)), **timer)
    ok = min(sqnr.values()) >= LINEAR_SQNR_MIN_DB
    shape = f"{name} {k}x{n}"  # K x N; M in the row
    fwd = {"name": f"Float8Linear fwd {shape}", "unit": "ms", "baseline": fwd_bf16, "baseline_label": "bf16",
           "value": fwd_fp8, "value_label": "jet", "ratio": fwd_bf16 / fwd_fp8, "m": m, "k": k, "n": n}
    fb = {"name": f"Float8Linear fwd+bwd {shape}", "unit": "ms", "baseline": fb_bf16, "baseline_label": "bf16",
          "value": fb_fp8, "value_label": "jet", "ratio": fb_bf16 / fb_fp8, "m": m, "k": k, "n": n,
          "gemms_only_ms_bf16": gemms_bf16, "gemms_only_ms_fp8": gemms_fp8, "gemms_only_ratio": gemms_bf16 / gemms_fp8,
          "act_quant_ms": act_quant, "host_ms_bf16": host_bf16, "host_ms_fp8": host_fp8,
          "sqnr_db": sqnr, "check": status(ok),
          "check_detail": f"SQNR y/dx/dw {sqnr['y']:.1f}/{sqnr['dx']:.1f}/{sqnr['dw']:.1f} dB",
          "note": f"3 GEMMs alone {gemms_bf16 / gemms_fp8:.2f}x; act quant {act_quant:.3f} ms; host {host_fp8:.2f} "
                  f"ms per FP8 call (bf16 {host_bf16:.2f})"}
    set_target(fb, ">=", LINEAR_TARGET, smoke=cfg.smoke)
    fb.update(ao)
    if "torchao_ms" in ao:
        fb_ao = ao["torchao_ms"]
        fb.update(ratio_torchao_vs_bf16=fb_bf16 / fb_ao, ratio_vs_torchao=fb_ao / fb_fp8)
        fb["note"] += f"; {ao['torchao']} {fb_bf16 / fb_ao:.2f}x bf16 (jet {fb_ao / fb_fp8:.2f}x torchao)"
    return [fwd, fb]


def _gemm_layouts(cfg: BenchConfig, device: torch.device) -> dict[str, Any]:
    """fprop / dgrad / wgrad operand layouts of the dispatched FP8 GEMM vs the emulation (M=1, partial K)."""
    _, k, n = cfg.layer_gemms()[0]
    shapes = [(cfg.linear_tokens, n, k), (1, n, k), (40, 256, 576)]
    worst, errors = 0.0, []
    for m, n, k in shapes:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        dy = torch.randn(m, n, device=device, dtype=torch.bfloat16)
        wq = quantize(w, (128, 128))
        layouts = {"fprop": (quantize(x), wq), "dgrad": (quantize(dy), wq.t()),
                   "wgrad": (quantize(dy.t()), quantize(x.t()))}
        for layout, (a, b) in layouts.items():
            try:
                err = rel_err(fp8_gemm(a, b, torch.float32), gemm_emulated(a, b, torch.float32))
                worst = max(worst, err)
            except Exception as exc:  # noqa: BLE001 -- reported in the check
                errors.append(f"{layout} {m}x{n}x{k}: {type(exc).__name__}: {exc}"[:200])
    ok = not errors and worst < GEMM_REL_ERR_MAX
    detail = f"max rel err {worst:.1e}" + (f"; {'; '.join(errors)}" if errors else "")
    return {"name": "FP8 GEMM fprop/dgrad/wgrad vs emulated", "check": status(ok), "check_detail": detail,
            "max_rel_err": worst, "shapes": shapes, "backend": gemm_module.resolve_backend(device)}


# ------------------------------------------------------------------------------------------ (c)
def _fp8_backends(device: torch.device) -> list[str]:
    """The FP8 GEMM backends to time one by one: every fast one on CUDA, the emulation on CPU."""
    if device.type != "cuda":
        return ["emulated"]
    return [b for b in gemm_module.BACKENDS if b != "emulated"]


def _dispatch_pick(m: int, n: int, k: int, device: torch.device) -> str:
    backend = gemm_module.resolve_backend(device)
    return gemm_module.choose_backend(m, (128, 128), n, k) if backend == "auto" else backend


L2_FLUSH_BYTES = 150_000_000  # weight bytes per timed layer set: 3x the H200's 50 MB L2


def decode_gemms(cfg: BenchConfig, device: torch.device) -> list[dict[str, Any]]:
    graph = {"calls": cfg.graph_calls, "replays": cfg.graph_replays}
    backends = _fp8_backends(device)
    rows = []
    sums: dict[int, dict[str, float]] = {m: {"bf16": 0.0, "fp8": 0.0, "floor": 0.0} for m in cfg.decode_ms}
    for name, k, n in cfg.layer_gemms():
        torch.manual_seed(0)
        # Several copies of the layer, used in turn by the captured calls, so that no timing is an
        # L2 hit on the previous call's weight (H200 L2: 50 MB; an FP8 4096x4096 weight is 17 MB).
        num_copies = 1 if cfg.smoke else min(16, max(2, -(-L2_FLUSH_BYTES // (n * k))))
        layers = [_decode_layer(name, n, k, device) for _ in range(num_copies)]
        floor_us = (layers[0][1].codes.nbytes + layers[0][1].scales.nbytes) / HBM_BYTES_PER_S * 1e6
        for m in cfg.decode_ms:
            label = f"decode GEMM {name} M={m} N={n} K={k}"
            try:
                row = _decode_row(label, m, n, k, layers, backends, device, graph)
            except Exception as exc:  # noqa: BLE001 -- recorded in the row; the other shapes still run
                rows.append(error_row(label, exc))
                for key in sums[m]:
                    sums[m][key] = float("nan")
                continue
            row["floor_us"] = floor_us
            rows.append(row)
            sums[m]["bf16"] += row["baseline"]
            sums[m]["fp8"] += row["value"]
            sums[m]["floor"] += floor_us
    for m, s in sums.items():
        row = {"name": f"decode GEMMs sum of 4, M={m}", "unit": "us", "baseline": s["bf16"], "baseline_label": "bf16",
               "value": s["fp8"], "value_label": "fp8", "ratio": s["bf16"] / s["fp8"], "floor_us": s["floor"],
               "floor_ratio": s["bf16"] / s["floor"] if s["floor"] else None,
               "note": f"FP8 bytes floor {s['floor']:.1f} us"}
        if m <= DECODE_SUM_MAX_M:
            set_target(row, ">=", DECODE_SUM_TARGET, smoke=cfg.smoke)
        rows.append(row)
    for m in cfg.decode_ms:
        label = f"decode projections separate vs stacked, M={m}"
        rows.append(guarded(label, partial(_stacking_row, cfg, m, device, graph)))
    return rows


def _stacking_row(cfg: BenchConfig, m: int, device: torch.device, graph: dict) -> dict[str, Any]:
    """q, k, v, gate, up as five GEMMs against two stacked ones (qkv, gate_up), BF16 and FP8 (``jet`` rollout).

    What the FP8 projection groups (jetrl/fp8/projection_group.py) save, and what stacking saves BF16:
    ``bf16_stacked`` is what the BF16 engine runs (jetrl/models/stacked_projections.py), ``bf16_qkv_stacked``
    q/k/v stacked with gate and up separate.
    """
    q_out, kv_out = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    sizes = {"q": q_out, "k": kv_out, "v": kv_out, "gate": cfg.intermediate, "up": cfg.intermediate}
    torch.manual_seed(0)
    weights = {name: torch.randn(n, cfg.hidden, device=device, dtype=torch.bfloat16) * 0.02
               for name, n in sizes.items()}
    stacked = [torch.cat([weights["q"], weights["k"], weights["v"]]), torch.cat([weights["gate"], weights["up"]])]
    x = torch.randn(m, cfg.hidden, device=device, dtype=torch.bfloat16)

    separate_fp8 = [_jet_linear(w, f"stacking.{name}") for name, w in weights.items()]  # no groups: five GEMMs
    stacked_fp8 = [_jet_linear(w, f"stacking.{name}") for w, name in zip(stacked, ("qkv", "gate_up"))]

    def run(fns: list) -> Any:
        """Each captured call on fresh copies of the two inputs (attention's for q, k, v, the MLP's for gate,
        up), so it pays the two input quantizations a layer pays (Float8Linear memoizes one per tensor)."""
        n_attn = 3 if len(fns) == 5 else 1
        copies = [(x.clone(), x.clone()) for _ in range(graph["calls"])]
        return _in_turn([lambda a=a, b=b: [fn(a if i < n_attn else b) for i, fn in enumerate(fns)]
                         for a, b in copies])

    bf16_sep = [partial(F.linear, weight=w) for w in weights.values()]
    bf16_st = [partial(F.linear, weight=w) for w in stacked]
    bf16_qkv = [partial(F.linear, weight=w) for w in (stacked[0], weights["gate"], weights["up"])]
    with torch.no_grad(), precision_phase("rollout"):
        sep, st = torch.cat([f(x) for f in separate_fp8], 1), torch.cat([f(x) for f in stacked_fp8], 1)
        bf16_sep_out, bf16_st_out = torch.cat([f(x) for f in bf16_sep], 1), torch.cat([f(x) for f in bf16_st], 1)
        err = max(rel_err(st, sep), rel_err(bf16_st_out, bf16_sep_out))
        times = {key: graph_time_us(run(fns), device, **graph) for key, fns in
                 (("bf16_separate", bf16_sep), ("bf16_stacked", bf16_st), ("bf16_qkv_stacked", bf16_qkv),
                  ("fp8_separate", separate_fp8),
                  ("fp8_stacked", stacked_fp8))}
    return {"name": f"decode projections separate vs stacked, M={m}", "unit": "us",
            "baseline": times["bf16_separate"], "baseline_label": "bf16 5 GEMMs", "value": times["bf16_stacked"],
            "value_label": "bf16 2 GEMMs", "ratio": times["bf16_separate"] / times["bf16_stacked"], **times,
            "fp8_ratio": times["fp8_separate"] / times["fp8_stacked"], "rel_err": err,
            "check": status(err < GEMM_REL_ERR_MAX), "check_detail": f"stacked vs separate rel err {err:.1e}",
            "note": (f"q,k,v,gate,up; bf16 qkv stacked + gate, up {times['bf16_qkv_stacked']:.1f} us; "
                     f"fp8 5 GEMMs {times['fp8_separate']:.1f} us, "
                     f"2 GEMMs {times['fp8_stacked']:.1f} us "
                     f"({times['fp8_separate'] / times['fp8_stacked']:.2f}x); stacked fp8 vs separate bf16 "
                     f"{times['bf16_separate'] / times['fp8_stacked']:.2f}x, stacked both "
                     f"{times['bf16_stacked'] / times['fp8_stacked']:.2f}x")}


def rotating_weights(n: int, k: int, device: torch.device) -> tuple[list[Float8Blocks], list[torch.Tensor]]:
    """FP8 (128x128 blocks) and BF16 copies of random (n, k) weights, >= L2_FLUSH_BYTES of each, so that
    captured calls taking them in turn (:func:`taking_turns`) never find the weight in L2 (sweep scripts)."""
    copies = max(2, -(-L2_FLUSH_BYTES // (n * k)))
    fp8 = [quantize(torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02, (128, 128)) for _ in range(copies)]
    bf16 = [torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(max(2, copies // 2))]
    return fp8, bf16


def taking_turns(fn: Callable[[Any], object], pool: list) -> Callable[[], object]:
    """One callable that runs ``fn(pool[0])``, ``fn(pool[1])``, ... in turn."""
    return _in_turn([partial(fn, item) for item in pool])


def _decode_layer(name: str, n: int, k: int, device: torch.device) -> tuple[torch.Tensor, Float8Blocks, Float8Linear]:
    """A random (n, k) BF16 weight, its FP8 blocks and a ``jet`` Float8Linear on it."""
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
    return w, quantize(w, (128, 128)), _jet_linear(w, f"decode.{name}")


def _jet_linear(w: torch.Tensor, name: str) -> Float8Linear:
    """A bias-free ``jet`` Float8Linear on the frozen weight ``w`` (N, K)."""
    linear = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(w, requires_grad=False)
    return Float8Linear.from_float(linear, get_recipe("jet"), name=f"bench.{name}")


def _in_turn(calls: list) -> Any:
    """One callable that runs ``calls[0]``, ``calls[1]``, ... in turn (each captured call hits another copy)."""
    state = {"i": 0}

    def run() -> object:
        state["i"] += 1
        return calls[state["i"] % len(calls)]()

    return run


def _decode_row(label: str, m: int, n: int, k: int, layers: list, backends: list[str], device: torch.device,
                graph: dict) -> dict[str, Any]:
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    xq = quantize(x)
    w, wq, fp8 = layers[0]
    spec = gemm_emulated(xq, wq, torch.float32)
    row: dict[str, Any] = {"name": label, "unit": "us", "m": m, "n": n, "k": k, "baseline_label": "bf16",
                           "value_label": "fp8", "pick": _dispatch_pick(m, n, k, device), "weight_copies": len(layers)}
    row["baseline"] = graph_time_us(_in_turn([partial(F.linear, x, lw) for lw, _, _ in layers]), device, **graph)
    errs, failures = {}, []
    for backend in backends:
        try:
            with override_backend(backend):
                errs[backend] = rel_err(fp8_gemm(xq, wq), spec)
                row[f"{backend}_us"] = graph_time_us(_in_turn([partial(fp8_gemm, xq, lq) for _, lq, _ in layers]),
                                                     device, **graph)
        except Exception as exc:  # noqa: BLE001 -- a declared backend failing on an 8B decode shape is an error
            row[f"{backend}_us"] = None
            failures.append(f"{backend}: {type(exc).__name__}: {exc}"[:200])
    # one input copy per call: Float8Linear memoizes an input's quantization per tensor object, and a
    # decode step quantizes every layer input once, so each timed call must quantize its own
    xs = [x.clone() for _ in layers]
    with torch.no_grad(), precision_phase("rollout"):
        errs["fp8"] = rel_err(fp8(x), spec)
        row["value"] = graph_time_us(_in_turn([partial(mod, xi) for (_, _, mod), xi in zip(layers, xs)]), device,
                                     **graph)
    row["ratio"] = row["baseline"] / row["value"]
    row["rel_err"] = errs
    ok = all(e < GEMM_REL_ERR_MAX for e in errs.values())
    row["check"] = status(ok)
    row["check_detail"] = "rel err " + " ".join(f"{b} {e:.1e}" for b, e in errs.items())
    row["note"] = f"pick {row['pick']}; " + " ".join(
        f"{b} {row[f'{b}_us']:.1f}us" for b in backends if row.get(f"{b}_us") is not None)
    if failures:
        row["error"] = "; ".join(failures)
    return row
