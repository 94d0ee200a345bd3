"""Why only the two quantize kernels take the bare cast (``BARE_CAST`` in jetrl/fp8/kernels/quant_triton.py):
a question for the GPU, and a reproducer to re-run when Triton changes.

With the bare cast in every kernel (run BJ) the K/V fake quantization, which decodes its own codes in the same
kernel, gave wrong values. This kernel does that too, at (4800, 128) fp32: it quantizes each row with the quantizer's
row function, stores the codes, and decodes them in registers, once with the clamp and the NaN select before the
cast and once bare. Run BM on the H200 (Triton 3.6): with the clamp, values and codes bit-equal to
``quantize_reference``; bare, the *stored codes* are bit-equal too, but half the decoded values are wrong (columns 0
and 1 of every 4: code 137, -0.0088, decoded as 160.0) -- the in-register round trip fp32 -> E4M3 -> f16 reads the
wrong half of the cast's packed result once nothing sits between the two conversions. So the bare cast is used only
where the codes go straight to memory.

    PYTHONPATH=. python3 bench/probe_bare_cast.py
"""

import torch
import triton
import triton.language as tl

from jetrl.fp8.kernels import quant_triton as qt
from jetrl.fp8.quant import quantize_reference


@triton.jit
def qdq(x_ptr, out_ptr, codes_ptr, N, D: tl.constexpr, TILE_R: tl.constexpr, BARE: tl.constexpr, POW2: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * TILE_R + tl.arange(0, TILE_R)
    ok = rows < N
    cols = tl.arange(0, D)
    x = tl.load(x_ptr + rows[:, None] * D + cols[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    code_bits, scale = qt._quantize_rows(x, POW2, False, BARE)
    y = code_bits.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, None]
    tl.store(out_ptr + rows[:, None] * D + cols[None, :], y, mask=ok[:, None])
    tl.store(codes_ptr + rows[:, None] * D + cols[None, :], code_bits, mask=ok[:, None])


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(4800, 128, device="cuda") * torch.logspace(-2, 2, 128, device="cuda")
    rc, rs = quantize_reference(x, 1, 128, True)
    ref = (rc.float() * rs).cpu()
    rc = rc.view(torch.uint8).cpu()
    for bare in (False, True):
        out = torch.empty_like(x)
        codes = torch.empty(x.shape, dtype=torch.uint8, device="cuda")
        qdq[(4800 // 32,)](x, out, codes, 4800, D=128, TILE_R=32, BARE=bare, POW2=True, num_warps=4)
        out, codes = out.cpu(), codes.cpu()
        bad = (out.view(torch.int32) != ref.view(torch.int32))
        badc = codes != rc
        print(f"bare={bare}: values differing {int(bad.sum())}, codes differing {int(badc.sum())} of {bad.numel()}")
        if bad.any():
            r, c = bad.nonzero()[0].tolist()
            print("  first at", (r, c), "x", float(x[r, c]), "got", float(out[r, c]), "want", float(ref[r, c]),
                  "codes got/want", int(codes[r, c]), int(rc[r, c]),
                  "neighbours want", ref[r, max(c - 1, 0):c + 2].tolist())
            decoded = codes.view(torch.float8_e4m3fn).float() * rs.cpu()
            neighbour = (out[bad] == ref.roll(1, 1)[bad]) | (out[bad] == ref.roll(-1, 1)[bad])
            print("  stored codes decode to the right value at those places:", bool((decoded[bad] == ref[bad]).all()),
                  "; got == some neighbour's want:", bool(neighbour.float().mean() > 0.9))
            cols = bad.nonzero()[:, 1]
            print("  columns hit (mod 4):", torch.bincount(cols % 4, minlength=4).tolist(),
                  "sample", cols[:12].tolist())


if __name__ == "__main__":
    main()
