"""One-pass kernels for both 1x128 layouts of x (the trainer's dual-layout quantizer) against each other and the
two single-layout passes (a question for the H200).

The kernel before run AU quantized x^T from column amaxes and moved the *codes* into the transposed layout: the
SASS of that move is byte-wise shared-memory traffic (``LDS.U8`` / ``LDS.U16``), and on the H200 it ran at 1.6
TB/s against 3.2 for the single-layout pass (docs/benchmarks.md (a)). Candidates, each one program per (128 x
128) tile and the quantizer's own row function (``quantize_rows``) for both layouts:

* ``reload`` (shipped since run AV: ``quantize_dual_triton``): quantize the tile's rows, then load the tile
  again transposed, CHUNK k-columns at a time (the second read hits L2), and quantize those rows. Triton still
  moves the x^T codes between the load's layout (k contiguous per thread) and the store's (m contiguous)
  through shared memory, a byte at a time;
* ``trans`` (``CANDIDATES=all``): quantize the rows of ``tl.trans(tile)`` instead of re-reading (slower, run AU);
* ``gluon`` (run AY: 1.13-1.15x slower than ``reload``): ``reload`` in Gluon, which states the layouts: the
  transposed read puts 16 consecutive m of one k in each thread and consecutive k in consecutive lanes (each
  load instruction reads 64 contiguous bytes of x), so the codes are quantized where they are stored, 16 bytes
  per thread, and no value crosses threads but the amax reduction. Compiled for sm_90 (8 warps): 2880 SASS
  instructions against the shipped kernel's 2616, 64 two-byte loads per thread in place of its 64 one-byte
  shared-memory stores;
* ``gluon_cvt`` (run AY: 1.17-1.18x slower than ``reload``): the same, but the transposed tile is read 16 bytes
  at a time along k and its bf16 values are moved into the store's layout by Gluon's layout conversion, which
  compiles to the hardware's transposing matrix stores and loads (per thread and tile, at 8 warps: 8 ``STSM`` + 8
  ``LDSM.MT88`` and 16 ``LDG.E.128``, against the shipped kernel's 64 ``STS.U8``; 2720 SASS instructions).
  Gluon has no interpreter: on CPU ``SASS_ONLY=1`` compiles every candidate for sm_90 and prints its memory
  instructions instead;

Measured and removed (their code is in commit ba8787a): ``packed`` / ``gluon_packed`` (run BH, 1.25-2x *slower*):
x read once as four (32, 128) tensors of rows 4i + j, both layouts quantized from the same registers, x^T's codes of
rows 4i..4i+3 packed into one 32-bit word; ``reload_c`` / ``_nc`` / ``_nn`` (run BI): ``reload`` with the clamp
before the cast, without it, and without the clamp and the NaN select -- 85.8 / 78.9 / 67.8 µs at 9216 x 4096, all
bit for bit, hence the bare cast of ``quantize_dual_triton``; ``fastdiv`` (run BO, in commit 8423098 with its CPU proof
``bench/prove_fast_scale.py``): ``reload`` with the scales computed without a division (an FMA-corrected product with
RN(1/448), ``rcp.approx`` and two Newton steps), bit-equal and 2-5% *slower* at 128 / 8 (1776 SASS instructions per
thread against 2048, but no faster).

Every candidate is checked bit for bit against ``quantize_reference`` of x and of x.t() (NaN and pow2 scales
included) before it is timed under CUDA-graph replay. GPU only, but for ``CHECK_ONLY=1`` (the Triton candidates
under TRITON_INTERPRET=1) and ``SASS_ONLY=1``:

    PYTHONPATH=. OUT=$OUT python3 bench/sweep_quant_dual_v2.py

Result (runs AU, AV, AY, BH and BI, docs/benchmarks.md (a)): ``reload`` with 128-wide chunks and 8 warps, 1.14-1.18x
the kernel before it and 0.97-0.99x the two passes, is ``quantize_dual_triton`` itself (with the bare cast since run
BI: 1.25x faster again; run BN: still the best launch grid with it, ``CANDIDATES=reload``); no Gluon or packed
candidate beat it at any chunk or warp count.
"""

import collections
import functools
import json
import os
import re

import torch
import triton
import triton.language as tl

from jetrl.bench.timing import graph_time_us
from jetrl.fp8.kernels.quant_triton import explicit_round, quantize_dual_triton, quantize_rows, quantize_triton
from jetrl.fp8.quant import E4M3, quantize_reference


@triton.jit
def _dual_trans(x_ptr, codes_ptr, scales_ptr, codes_t_ptr, scales_t_ptr, M, K, stride_xm, stride_xk,
                num_k_groups, num_m_groups, POW2: tl.constexpr, EXPLICIT_ROUND: tl.constexpr):
    pid_k, pid_m = tl.program_id(0), tl.program_id(1)
    rows = pid_m.to(tl.int64) * 128 + tl.arange(0, 128)
    cols = pid_k.to(tl.int64) * 128 + tl.arange(0, 128)
    row_ok, col_ok = rows < M, cols < K
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xk,
                mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    code_bits, scale = quantize_rows(x.to(tl.float32), POW2, EXPLICIT_ROUND)
    tl.store(codes_ptr + rows[:, None] * K + cols[None, :], code_bits, mask=row_ok[:, None] & col_ok[None, :])
    tl.store(scales_ptr + rows * num_k_groups + pid_k, scale, mask=row_ok)
    code_t, scale_t = quantize_rows(tl.trans(x).to(tl.float32), POW2, EXPLICIT_ROUND)
    tl.store(codes_t_ptr + cols[:, None] * M + rows[None, :], code_t, mask=col_ok[:, None] & row_ok[None, :])
    tl.store(scales_t_ptr + cols * num_m_groups + pid_m, scale_t, mask=col_ok)


@functools.cache
def _gluon_kernel():
    """The Gluon candidate, defined once on first use (Gluon needs Triton >= 3.6)."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    @gluon.jit
    def _dual_gluon(x_ptr, codes_ptr, scales_ptr, codes_t_ptr, scales_t_ptr, M, K, stride_xm, num_k_groups,
                    num_m_groups, POW2: gl.constexpr, EXPLICIT_ROUND: gl.constexpr, CHUNK: gl.constexpr,
                    CONVERT: gl.constexpr, num_warps: gl.constexpr):
        pid_k, pid_m = gl.program_id(0), gl.program_id(1)
        # x's rows: 8 consecutive k per thread (16-byte loads), 16 lanes per 128-wide row
        rl: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
        rows = pid_m.to(gl.int64) * 128 + gl.arange(0, 128, layout=gl.SliceLayout(1, rl))
        cols = pid_k.to(gl.int64) * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, rl))
        mask = (rows < M)[:, None] & (cols < K)[None, :]
        x = gl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
        code_bits, scale = quantize_rows(x.to(gl.float32), POW2, EXPLICIT_ROUND)
        gl.store(codes_ptr + rows[:, None] * K + cols[None, :], code_bits, mask=mask)
        gl.store(scales_ptr + rows * num_k_groups + pid_k, scale, mask=rows < M)
        # x^T's rows: 16 consecutive m per thread (one 16-byte store of codes), consecutive k in consecutive lanes
        # (a layout with 2 consecutive k per thread as well loads 4 bytes at a time but, its register order being
        # k-first, stores the codes a byte at a time: compiled and dropped)
        lt: gl.constexpr = gl.BlockedLayout([1, 16], [32, 1], [1, num_warps], [1, 0])
        # CONVERT: read the transposed tile 8 consecutive k per thread (16-byte loads), then move the bf16 values
        # into ``lt`` through shared memory (Gluon's layout conversion) instead of loading them 2 bytes at a time
        ld: gl.constexpr = gl.BlockedLayout([8, 1], [CHUNK // 8, 256 // CHUNK], [1, num_warps], [0, 1])  # CHUNK 32-128
        mt = pid_m.to(gl.int64) * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, lt))
        for c in gl.static_range(128 // CHUNK):
            kc = pid_k.to(gl.int64) * 128 + c * CHUNK + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, lt))
            mask_t = (kc < K)[:, None] & (mt < M)[None, :]
            if CONVERT:
                mv = pid_m.to(gl.int64) * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, ld))
                kv = pid_k.to(gl.int64) * 128 + c * CHUNK + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, ld))
                xv = gl.load(x_ptr + mv[None, :] * stride_xm + kv[:, None],
                             mask=(kv < K)[:, None] & (mv < M)[None, :], other=0.0)
                xt = gl.convert_layout(xv, lt)
            else:
                xt = gl.load(x_ptr + mt[None, :] * stride_xm + kc[:, None], mask=mask_t, other=0.0)
            code_t, scale_t = quantize_rows(xt.to(gl.float32), POW2, EXPLICIT_ROUND)
            gl.store(codes_t_ptr + kc[:, None] * M + mt[None, :], code_t, mask=mask_t)
            gl.store(scales_t_ptr + kc * num_m_groups + pid_m, scale_t, mask=kc < K)

    return _dual_gluon


def _outputs(x):
    m, k = x.shape
    gm, gk = triton.cdiv(m, 128), triton.cdiv(k, 128)
    def scales(rows, groups):
        return torch.empty((rows, groups), dtype=torch.float32, device=x.device)

    return (torch.empty((m, k), dtype=E4M3, device=x.device), scales(m, gk),
            torch.empty((k, m), dtype=E4M3, device=x.device), scales(k, gm))


def _launch_args(x, outs):
    codes, scales, codes_t, scales_t = outs
    m, k = x.shape
    return (x, codes.view(torch.uint8), scales, codes_t.view(torch.uint8), scales_t, m, k, x.stride(0))


def dual_candidate(x, pow2, kind, chunk, warps):
    """(codes, scales, codes_t, scales_t) of x by candidate ``kind`` (module docstring)."""
    if kind.startswith("reload"):  # reload[/r<ROWS>][/n<maxnreg>]
        opts = {p[0]: int(p[1:]) for p in kind.split("/")[1:]}
        launch = {"maxnreg": opts["n"]} if "n" in opts else {}
        return quantize_dual_triton(x, pow2, chunk=chunk, rows=opts.get("r", 128), num_warps=warps, **launch)
    assert x.stride(1) == 1, "the candidates read x with unit column stride"
    outs = _outputs(x)
    gm, gk = triton.cdiv(x.shape[0], 128), triton.cdiv(x.shape[1], 128)
    if kind == "trans":
        _dual_trans[(gk, gm)](*_launch_args(x, outs), 1, gk, gm, POW2=pow2, EXPLICIT_ROUND=explicit_round(),
                              num_warps=warps)
    else:
        _gluon_kernel()[(gk, gm)](*_launch_args(x, outs), gk, gm, POW2=pow2, EXPLICIT_ROUND=False, CHUNK=chunk,
                                  CONVERT=kind == "gluon_cvt", num_warps=warps)
    return outs


def bits(t):
    return t.view(torch.uint8) if t.dtype == E4M3 else t.view(torch.int32)


# run AU also timed ``trans`` at 4 / 8 / 16 warps and ``reload`` at 32 / 4-8 and 64 / 4: all slower than ``reload``
# 64 / 8; run AV ``reload`` at 64 and 128 with 8 and 16 warps (docs/benchmarks.md (a)). CANDIDATES=all times them all.
CANDIDATES = [("reload", 128, 8)] + [(g, c, w) for g in ("gluon", "gluon_cvt") for c in (32, 64, 128) for w in (4, 8)]
if os.environ.get("CANDIDATES") == "reload":  # run BN: the shipped kernel's launch grid again, with the bare cast
    CANDIDATES = [("reload", c, w) for c in (32, 64, 128) for w in (4, 8, 16)]
if os.environ.get("CANDIDATES") == "occupancy":  # run DM: ncu (run DL) found the kernel register-bound at 2 tiles per SM
    CANDIDATES = ([(f"reload/r{r}", c, w) for c in (32, 64, 128) for r in (32, 64, 128) for w in (4, 8, 16)]
                  + [(f"reload/r{r}/n{n}", c, 8) for c, r in ((128, 128), (128, 64), (64, 64), (32, 32))
                     for n in (64, 80, 96)])
if os.environ.get("CANDIDATES") == "occupancy2":  # run DN: around run DM's best (64 rows, 32-wide chunks, 4 warps)
    CANDIDATES = ([(f"reload/r{r}" + (f"/n{n}" if n else ""), c, 4) for r, c in ((64, 32), (32, 32), (64, 16))
                   for n in (0, 64, 72, 80, 96)]
                  + [("reload/r32", 16, 2), ("reload/r64", 16, 2), ("reload/r32", 32, 2), ("reload/r128/n80", 32, 8),
                     ("reload/r64/n80", 32, 8), ("reload/r128", 128, 8)])
if os.environ.get("CANDIDATES") == "all":
    CANDIDATES = ([("trans", 128, w) for w in (4, 8, 16)]
                  + [(kd, c, w) for kd in ("reload", "gluon", "gluon_cvt") for c in (32, 64, 128) for w in (4, 8, 16)])


def sass_mix() -> None:
    """On any machine: each candidate compiled for sm_90 as a launch at 9216 x 4096 would be; its memory ops."""
    from jetrl.bench.sass import compile_like_launch, sass

    m, k = 9216, 4096
    ptrs = {"x_ptr": torch.empty(1, dtype=torch.bfloat16), "codes_ptr": torch.empty(1, dtype=torch.uint8),
            "scales_ptr": torch.empty(1), "codes_t_ptr": torch.empty(1, dtype=torch.uint8),
            "scales_t_ptr": torch.empty(1)}
    dims = {"M": m, "K": k, "stride_xm": k, "num_k_groups": k // 128, "num_m_groups": m // 128}
    dual_dims = {"M": m, "K": k, "stride_xm": k, "stride_xk": 1, "stride_sm": k // 128, "stride_sg": 1,
                 "stride_tk": m // 128, "stride_tg": 1}
    from jetrl.fp8.kernels import quant_triton

    for kind, chunk, warps in CANDIDATES:
        if kind.startswith("gluon"):
            fn = _gluon_kernel()
            consts = {"POW2": False, "EXPLICIT_ROUND": False, "CHUNK": chunk, "CONVERT": kind == "gluon_cvt",
                      "num_warps": warps}
            args = {**ptrs, **dims}
        elif kind.startswith("reload"):
            rows = {p[0]: int(p[1:]) for p in kind.split("/")[1:]}.get("r", 128)
            fn, consts = quant_triton._quantize_dual_kernel, {"POW2": False, "EXPLICIT_ROUND": False, "CHUNK": chunk,
                                                               "ROWS": rows}
            args = {**ptrs, **dual_dims}
        else:
            fn, consts = _dual_trans, {"POW2": False, "EXPLICIT_ROUND": False}
            args = {**ptrs, **dims, "stride_xk": 1}
        code = sass(compile_like_launch(fn, args, consts, num_warps=warps, num_stages=1))
        ops = collections.Counter(m.group(1) for m in re.finditer(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", code))
        mem = {o: n for o, n in sorted(ops.items()) if o.startswith(("LDG", "STG", "LDS", "STS", "BAR"))}
        print(f"{kind:7} chunk {chunk:3d} warps {warps:2d}: {sum(ops.values()):5d} SASS instructions; {mem}")


def main() -> None:
    if os.environ.get("SASS_ONLY"):
        sass_mix()
        return
    dev = torch.device("cpu" if os.environ.get("CHECK_ONLY") else "cuda")
    # partial tiles (200 x 300) are checked, not timed
    gpu_shapes = [(200, 300), (9216, 4096), (9216, 6144), (9216, 12288), (9216, 24576)]
    shapes = [(256, 384), (196, 200)] if dev.type == "cpu" else gpu_shapes
    res = []
    for m, k in shapes:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16) * torch.logspace(-3, 3, k, device=dev).to(
            torch.bfloat16)
        x[3, 5] = float("nan")
        for pow2 in (False, True):
            want = (*quantize_reference(x, 1, 128, pow2), *quantize_reference(x.t(), 1, 128, pow2))
            for kind, chunk, warps in CANDIDATES:
                if kind.startswith("gluon") and dev.type == "cpu":
                    continue  # no interpreter for Gluon
                row = {"m": m, "k": k, "pow2": pow2, "kind": kind, "chunk": chunk, "warps": warps}
                try:
                    got = dual_candidate(x, pow2, kind, chunk, warps)
                    row["bit_equal"] = all(torch.equal(bits(g), bits(w)) for g, w in zip(got, want))
                    if dev.type == "cuda" and not pow2 and m >= 1024:
                        def run(x=x, c=chunk, w=warps, kd=kind):
                            return dual_candidate(x, False, kd, c, w)

                        row["us"] = graph_time_us(run, dev, calls=5, replays=10)
                except Exception as exc:  # noqa: BLE001 -- a candidate that fails is reported, the sweep goes on
                    row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                res.append(row)
                print(row, flush=True)
        if dev.type == "cuda" and m >= 1024:
            nbytes = m * k * 4
            def two_passes(x=x):
                return quantize_triton(x, 1, 128, False), quantize_triton(x.t(), 1, 128, False)

            res.append({"m": m, "k": k, "pow2": False, "kind": "two passes",
                        "us": graph_time_us(two_passes, dev, calls=5, replays=10)})
            for r in res:
                if r.get("m") == m and r.get("k") == k and "us" in r:
                    r["tb_s"] = nbytes / r["us"] / 1e6
    if dev.type == "cuda":
        with open(os.path.join(os.environ.get("OUT", "."), "quant_dual_v2.json"), "w") as f:
            json.dump(res, f, indent=1)
        print(f"\n{'shape':>12} {'kind':10} {'chunk':>5} {'warps':>5} {'us':>8} {'TB/s':>6} bit-equal")
        for r in res:
            if "us" in r:
                print(f"{r['m']:>5}x{r['k']:<6} {r['kind']:10} {r.get('chunk', ''):>5} {r.get('warps', ''):>5} "
                      f"{r['us']:8.1f} {r['tb_s']:6.2f} {r.get('bit_equal', '')}")
    bad = [r for r in res if not r.get("bit_equal", "error" not in r)]
    assert not bad, f"candidates whose codes or scales differ from the reference, or that failed: {bad}"


if __name__ == "__main__":
    main()
