"""decode_attention: the reference against SDPA (the model's attention), the Triton kernel against the
reference under TRITON_INTERPRET=1 on CPU, its GPU branches compiled for sm_90 (no GPU needed), input
validation and backend selection.

The cache is built as the engine holds it: rows ``k_all[layer, :B]`` of a (L, slots, Hkv, S, D) tensor
(scales (L, slots, Hkv, S)), with every position the call may not read -- beyond lengths[b], other
layers, other slots -- poisoned with NaN (K) and Inf (V), or NaN codes and scales for FP8.

Tolerances (atol, rtol), kernel vs reference and reference vs SDPA: bf16 (1e-2, 2^-7), fp16 (1e-3,
2^-10), i.e. one ulp of the output dtype (both compute in fp32 and differ in summation order only,
then round once), fp32 (1e-5, 1e-5) (the kernel sums in fp32, the reference in fp64). Outputs are
O(1) averages of N(0, 4) values. A row with length 0 attends to position 0 alone, so it must equal
V_hat[b, :, 0] exactly.
"""

import math
import os

import pytest
import torch
import torch.nn.functional as F

from jetrl.engine.decode_attention import (
    _default_backend,
    decode_attention,
    decode_attention_backend,
    decode_attention_reference,
    longest_first,
    use_decode_attention_backend,
)
from jetrl.fp8.quant import E4M3

from .conftest import compile_for_sm90
from .subprocesses import run_interpreted

TOLERANCE = {torch.bfloat16: {"atol": 1e-2, "rtol": 2**-7}, torch.float16: {"atol": 1e-3, "rtol": 2**-10},
             torch.float32: {"atol": 1e-5, "rtol": 1e-5}}


def make_inputs(B, H, Hkv, S, D, lengths, dtype, fp8, *, stale_k=float("nan"), stale_v=float("inf"), seed=0,
                pow2=False):
    """q (B, H, D) strided, k/v (B, Hkv, S, D) views of a (2, B+2, Hkv, S, D) cache, scales, lengths.

    FP8 scales are amax / 448 per token-head, or with ``pow2`` the next power of two (the quantizer's
    pow2 rule); the values span ~2^-6..2^6 across token-heads, so a tile mixes very different scales."""
    g = torch.Generator().manual_seed(seed)
    num_layers, num_slots, layer = 2, B + 2, 1
    q = torch.randn(B, H, 2, D, generator=g).to(dtype)[:, :, 0]  # a strided view, like q[:, :, 0] in kv_cache
    lengths = torch.tensor(lengths, dtype=torch.int64)
    readable = torch.zeros(num_layers, num_slots, Hkv, S, dtype=torch.bool)  # what this call may read
    readable[layer, :B] = (torch.arange(S)[None, :] <= lengths[:, None])[:, None, :]

    def cache(stale):
        hp = torch.randn(num_layers, num_slots, Hkv, S, D, generator=g) * 2
        if pow2:
            hp = hp * torch.exp2(torch.randint(-6, 7, hp.shape[:-1], generator=g)).unsqueeze(-1)
        if not fp8:
            x = hp.to(dtype)
            x[~readable] = stale
            return x[layer, :B], None
        scales = hp.abs().amax(-1) / 448  # one scale per token per kv head; not a power of two
        if pow2:
            scales = torch.exp2(torch.ceil(torch.log2(scales)))
        codes = (hp / scales[..., None]).clamp(-448, 448).to(E4M3)
        codes.view(torch.uint8)[~readable] = 0x7E if math.isfinite(stale) else 0x7F  # 448 or NaN
        scales[~readable] = stale
        return codes[layer, :B], scales[layer, :B]

    (k, k_scales), (v, v_scales) = cache(stale_k), cache(stale_v)
    return q, k, v, lengths, k_scales, v_scales


def dequantized(x, scales, dtype):
    return x if scales is None else (x.float() * scales[..., None]).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)])
def test_reference_matches_sdpa_over_the_dequantized_cache(dtype, fp8, heads):
    H, Hkv = heads
    S, D = 24, 64
    q, k, v, lengths, ks, vs = make_inputs(3, H, Hkv, S, D, [0, 23, 9], dtype, fp8, stale_k=7.0, stale_v=-5.0)
    out = decode_attention_reference(q, k, v, lengths, k_scales=ks, v_scales=vs)
    k_hat, v_hat = dequantized(k, ks, dtype), dequantized(v, vs, dtype)
    mask = (torch.arange(S)[None, :] <= lengths[:, None])[:, None, None, :]  # (B, 1, 1, S), as kv_cache.decode_mask
    compute = torch.float64 if dtype == torch.float32 else dtype  # the model attends in fp64 for fp32 on CPU
    expected = F.scaled_dot_product_attention(
        q[:, :, None].to(compute), k_hat.to(compute), v_hat.to(compute), attn_mask=mask, enable_gqa=H != Hkv
    )[:, :, 0].to(dtype)
    assert out.dtype == dtype and out.shape == q.shape
    tolerance = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else TOLERANCE[dtype]  # fp64 on both sides
    torch.testing.assert_close(out, expected, **tolerance)


@pytest.mark.parametrize("fp8", [False, True])
def test_reference_never_reads_stale_positions(fp8):
    args = (4, 8, 2, 16, 64, [0, 15, 3, 7], torch.bfloat16, fp8)
    q, k, v, lengths, ks, vs = make_inputs(*args)  # NaN/Inf beyond lengths
    out = decode_attention_reference(q, k, v, lengths, k_scales=ks, v_scales=vs)
    q2, k2, v2, _, ks2, vs2 = make_inputs(*args, stale_k=0.0, stale_v=0.0)  # same live values, clean tail
    assert torch.equal(out, decode_attention_reference(q2, k2, v2, lengths, k_scales=ks2, v_scales=vs2))
    assert not out.isnan().any()
    v_hat = dequantized(v, vs, torch.bfloat16)
    assert torch.equal(out[0], v_hat[0, :, 0].repeat_interleave(4, dim=0))  # length 0: position 0 only


@pytest.mark.parametrize("head_dim", [64, 128])
def test_public_function_writes_o_projs_fp8_input(head_dim):
    """``quantized`` buffers receive quantize(out) of o_proj's (B, H * D) input, whichever path computes it."""
    from jetrl.fp8.quant import quantize
    from jetrl.models.fused import QuantizedOutput

    q, k, v, lengths, ks, vs = make_inputs(3, 4, 2, 40, head_dim, [39, 0, 17], torch.bfloat16, True)
    width = 4 * head_dim
    codes, scales = torch.zeros(3, width, dtype=E4M3), torch.zeros(width // 128, 3).t()
    out = decode_attention(q, k, v, lengths, k_scales=ks, v_scales=vs, quantized=QuantizedOutput(codes, scales, True))
    ref = quantize(out.reshape(3, width), (1, 128), pow2_scale=True)
    assert torch.equal(codes.view(torch.uint8), ref.codes.view(torch.uint8)) and torch.equal(scales, ref.scales)
    with pytest.raises(ValueError, match="quantized must hold contiguous float8_e4m3fn codes"):
        decode_attention(q, k, v, lengths, k_scales=ks, v_scales=vs,
                         quantized=QuantizedOutput(codes[:, :128], scales, True))


def test_public_function_runs_the_reference_on_cpu():
    q, k, v, lengths, ks, vs = make_inputs(2, 8, 2, 16, 64, [5, 15], torch.bfloat16, True)
    assert decode_attention_backend("cpu") == "reference"
    out = decode_attention(q, k, v, lengths, k_scales=ks, v_scales=vs)
    assert torch.equal(out, decode_attention_reference(q, k, v, lengths, k_scales=ks, v_scales=vs, sm_scale=64**-0.5))
    assert longest_first(lengths).tolist() == [1, 0]  # the program order the engine passes; no effect on results
    ordered = decode_attention(q, k, v, lengths, k_scales=ks, v_scales=vs, row_order=longest_first(lengths))
    assert torch.equal(ordered, out)
    out = decode_attention(q, k, v, lengths, k_scales=ks, v_scales=vs, sm_scale=0.0625)
    assert torch.equal(out, decode_attention_reference(q, k, v, lengths, k_scales=ks, v_scales=vs, sm_scale=0.0625))


def _bad_inputs():
    """(error match, (q, k, v, lengths), scale kwargs) of calls that must raise."""
    q, k, v, lengths, ks, vs = make_inputs(2, 8, 2, 16, 64, [5, 15], torch.bfloat16, True)
    qb, kb, vb, _, _, _ = make_inputs(2, 8, 2, 16, 64, [5, 15], torch.bfloat16, False)
    k6, v6 = kb[:, :1].expand(2, 4, 16, 64), vb[:, :1].expand(2, 4, 16, 64)
    scales = {"k_scales": ks, "v_scales": vs}
    return [
        ("q must be bfloat16", (q.double(), kb, vb, lengths), {}),
        ("expects q \\(B, H, D\\)", (qb[:, None], kb, vb, lengths), {}),
        ("of one shape", (qb, kb, vb[:, :, :8], lengths), {}),
        ("H a multiple of Hkv", (qb[:, :6], k6, v6, lengths), {}),
        ("must agree on B and D", (qb[:1], kb, vb, lengths[:1]), {}),
        ("lengths must be \\(B,\\)", (qb, kb, vb, lengths.float()), {}),
        ("lengths must be \\(B,\\)", (qb, kb, vb, lengths[:1]), {}),
        ("lengths must lie in \\[0, S-1\\]", (qb, kb, vb, torch.tensor([5, 16])), {}),
        ("lengths must lie in \\[0, S-1\\]", (qb, kb, vb, torch.tensor([-1, 3])), {}),
        ("k and v must share a dtype", (qb, k, vb, lengths), scales),
        ("in q's dtype .* or float8_e4m3fn", (qb.half(), kb, vb, lengths), {}),
        ("in q's dtype .* or float8_e4m3fn", (qb, k.view(torch.uint8), v.view(torch.uint8), lengths), scales),
        ("needs k_scales", (q, k, v, lengths), {"v_scales": vs}),
        ("needs v_scales", (q, k, v, lengths), {"k_scales": ks}),
        ("k_scales must be fp32 \\(2, 2, 16\\)", (q, k, v, lengths), {**scales, "k_scales": ks.bfloat16()}),
        ("v_scales must be fp32 \\(2, 2, 16\\)", (q, k, v, lengths), {**scales, "v_scales": vs[..., :8]}),
        ("are for an FP8 .* cache; this cache is torch.bfloat16", (qb, kb, vb, lengths), {"k_scales": ks}),
        ("must be a torch.Tensor", (qb, kb, vb, [5, 15]), {}),
        ("row_order must be a \\(B,\\) = \\(2,\\) int64", (qb, kb, vb, lengths), {"row_order": lengths[:1]}),
        ("row_order must be a \\(B,\\)", (qb, kb, vb, lengths), {"row_order": lengths.float()}),
        ("row_order must be a permutation of 0..B-1", (qb, kb, vb, lengths), {"row_order": torch.tensor([1, 1])}),
    ]


@pytest.mark.parametrize("match,args,kwargs", _bad_inputs(), ids=lambda x: x if isinstance(x, str) else None)
def test_bad_inputs_raise_actionable_errors(match, args, kwargs):
    with pytest.raises((ValueError, TypeError), match=match):
        decode_attention(*args, **kwargs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_longest_first_on_cuda_is_the_stable_argsort():
    pytest.importorskip("triton")
    for n in (1, 256, 1000):
        lengths = torch.randint(0, 50, (n,), device="cuda") * 10
        assert torch.equal(longest_first(lengths), torch.argsort(lengths, descending=True, stable=True)), n


def test_backend_selection(monkeypatch):
    with use_decode_attention_backend("triton"):
        assert decode_attention_backend("cpu") == "triton"
        with use_decode_attention_backend("reference"):
            assert decode_attention_backend("cuda") == "reference"
        assert decode_attention_backend("cpu") == "triton"
        if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):  # CPU tensors need the interpreter
            q, k, v, lengths, _, _ = make_inputs(1, 4, 4, 8, 64, [3], torch.bfloat16, False)
            with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1|needs Triton"):
                decode_attention(q, k, v, lengths)
    assert decode_attention_backend("cpu") == "reference"
    with pytest.raises(ValueError, match="unknown decode attention backend"), use_decode_attention_backend("flash"):
        pass
    monkeypatch.setenv("JETRL_DECODE_ATTENTION", "flash")
    _default_backend.cache_clear()
    try:
        with pytest.raises(ValueError, match="JETRL_DECODE_ATTENTION='flash'"):
            decode_attention_backend("cpu")
        monkeypatch.setenv("JETRL_DECODE_ATTENTION", "reference")
        _default_backend.cache_clear()
        assert decode_attention_backend("cuda") == "reference"
    finally:
        _default_backend.cache_clear()


def test_num_splits_rule():
    pytest.importorskip("triton")
    from jetrl.engine.kernels.decode_attention_triton import choose_num_splits

    assert choose_num_splits(256, 8, 4096, 64, 132) == 1  # 2048 programs fill 132 SMs: no split, no merge
    assert choose_num_splits(128, 8, 4096, 64, 132) == 1
    assert choose_num_splits(64, 8, 4096, 64, 132) == 2
    assert choose_num_splits(16, 8, 4096, 64, 132) == 5
    assert choose_num_splits(1, 8, 4096, 64, 132) == 32  # capped at MAX_SPLITS
    assert choose_num_splits(1, 8, 256, 64, 132) == 2  # each split >= 2 tiles of the longest row
    assert choose_num_splits(1, 8, 64, 64, 132) == 1


def test_gpu_branches_compile_for_hopper():
    """The interpreter runs the kernels' EMULATE branches; this compiles the GPU branches (tensor-core
    dots, hardware casts, the software-pipelined loop) for sm_90 with Triton's bundled ptxas, no GPU,
    specialized as a launch over contiguous cache rows would be."""
    pytest.importorskip("triton")
    import triton.language as tl

    from jetrl.bench.sass import compile_like_launch, decode_attention_args
    from jetrl.engine.kernels import decode_attention_triton as kernels

    # every cache kind at its default tiles; G = 1 (MHA) and G = 8 too
    cases = zip(kernels.DEFAULT_TILES.items(), (4, 1, 8), (1, 4, 2), (True, False, True))
    for (kind, (block_s, warps, stages)), G, num_splits, order in cases:
        is_fp8 = kind.startswith("fp8")
        constexprs = {"G": G, "DTYPE": tl.bfloat16, "BLOCK_G": G, "BLOCK_S": block_s, "BLOCK_D": 128,
                      "NUM_SPLITS": num_splits, "IS_FP8": is_fp8, "POW2_SCALES": kind == "fp8 pow2", "ROW_ORDER": order,
                      "EMULATE": False, "P_TERMS": kernels.POW2_P_TERMS}
        compiled = compile_like_launch(kernels._decode_attention_kernel, decode_attention_args(is_fp8, H=8 * G, Hkv=8),
                                       constexprs, num_warps=warps, num_stages=stages)
        ptx = compiled.asm["ptx"]
        assert ("mma.sync" in ptx or "wgmma" in ptx) and compiled.asm["cubin"], kind
        if kind == "fp8 pow2":  # V's codes become fp16 where they are loaded (module docstring)
            assert "cvt.rn.f16x2.e4m3x2" in ptx and "ld.shared.u8" not in ptx and "ld.shared.b8" not in ptx
            # with o_proj's FP8 input written in the epilogue (hardware E4M3 conversion, no software rounding)
            quant = compile_like_launch(kernels._decode_attention_kernel, decode_attention_args(True),
                                        {**constexprs, "NUM_SPLITS": 1, "QUANT": True, "QUANT_POW2": True,
                                         "RELEASE": True}, num_warps=warps, num_stages=stages)
            assert "cvt.rn.satfinite.e4m3x2.f32" in quant.asm["ptx"], kind
            # as o_proj's producer it lets the PDL GEMM after it start (kernels/pdl.py); it never waits itself
            qptx = quant.asm["ptx"]
            assert "griddepcontrol.launch_dependents" in qptx and "griddepcontrol.wait" not in qptx
            assert "griddepcontrol" not in ptx
    constexprs = {"DTYPE": tl.bfloat16, "NUM_SPLITS": 4, "SPLITS_P2": 4, "BLOCK_S": 64, "BLOCK_D": 128,
                  "EMULATE": False}
    for quant in (False, True):
        merge = compile_for_sm90(kernels._merge_splits_kernel, {**constexprs, "QUANT": quant, "RELEASE": quant},
                                 {"lengths_ptr": "*i64", "out_ptr": "*bf16", "codes_ptr": "*u8"})
        assert merge.asm["cubin"] and ("griddepcontrol.launch_dependents" in merge.asm["ptx"]) == quant


# SASS instructions per loop iteration (one tile of BLOCK_S positions, one warp) at the default tiles,
# compiled as a B=256, S=1152 launch: the budget that the H200 rewrite of docs/benchmarks.md (d) met
# (pow2: 1121 -> 690 per 64 -> 32 positions, 184 -> 92 µs), with ~10% slack, and the two things that
# made the old loop slow, as regressions to catch on any machine.
LOOP_BUDGET = {"model dtype": 750, "fp8": 1420, "fp8 pow2": 700}  # pow2: 698 -> 630 with P as one fp16 term


def test_loop_instruction_budget():
    pytest.importorskip("triton")
    import triton.language as tl

    from jetrl.bench.sass import compile_like_launch, decode_attention_args, loop_mixes
    from jetrl.engine.kernels import decode_attention_triton as kernels

    counts = {}
    for kind, (block_s, warps, stages) in kernels.DEFAULT_TILES.items():
        fp8 = kind.startswith("fp8")
        constexprs = {"G": 4, "DTYPE": tl.bfloat16, "BLOCK_G": 4, "BLOCK_S": block_s, "BLOCK_D": 128, "NUM_SPLITS": 1,
                      "IS_FP8": fp8, "POW2_SCALES": kind == "fp8 pow2", "ROW_ORDER": True, "EMULATE": False,
                      "P_TERMS": kernels.POW2_P_TERMS}
        compiled = compile_like_launch(kernels._decode_attention_kernel, decode_attention_args(fp8), constexprs,
                                       num_warps=warps, num_stages=stages)
        (loop,) = loop_mixes(compiled)  # the tile loop, software-pipelined into one
        counts[kind] = loop.count
        assert loop.count <= LOOP_BUDGET[kind], (kind, loop.count, loop.mix.most_common(10))
        # 3 dots (q.K, and P.V as hi + lo), no more; 2 where P is one fp16 term (pow2 scales, POW2_P_TERMS = 1)
        dots = 2 if kind == "fp8 pow2" and kernels.POW2_P_TERMS == 1 else 3
        assert loop.mix["HMMA.16816.F32.BF16"] + loop.mix["HMMA.16816.F32"] == 16 * dots, (kind, loop.mix)
        if fp8:  # V reaches the mma layout as fp16 via ldmatrix, not one shared-memory byte load per code
            assert "LDS.U8" not in loop.mix, (kind, loop.mix.most_common(10))
    # pow2 scales leave only the E4M3 -> fp16 conversion per code: no fp32 dequantization in the loop
    assert counts["fp8 pow2"] < counts["fp8"] * 0.6, counts


# The kernel against its reference under the interpreter, in four independent scripts (run side by side).
KERNEL_PREAMBLE = r"""
import torch
from jetrl.engine.decode_attention import decode_attention, decode_attention_reference, use_decode_attention_backend
from jetrl.engine.kernels.decode_attention_triton import decode_attention_triton
from tests.test_decode_attention import TOLERANCE, dequantized, make_inputs

S = 80  # not a multiple of any BLOCK_S below: the last tile of a long row is partial
LENGTHS = [0, S - 1, S - 2, 37, 15]  # length 0 (position 0 only), lengths near S, a tile boundary
bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
CASES = [  # dtype, fp8 cache, H, Hkv, D, num_splits, block_s
    (bf16, False, 8, 2, 64, 1, 16), (bf16, False, 8, 2, 128, 3, 16), (bf16, False, 4, 4, 64, None, 16),
    (bf16, True, 8, 2, 128, 1, 32), (bf16, True, 8, 2, 64, 4, 16), (bf16, True, 4, 4, 128, 2, 16),
    (bf16, True, 4, 4, 64, 1, 64),
    (fp16, True, 8, 2, 64, 3, 16), (fp16, False, 4, 4, 64, 1, 32),
    (fp32, False, 8, 2, 64, 1, 16), (fp32, False, 8, 2, 64, 2, 32),
]
"""

KERNEL_SCRIPTS = [r"""
for i, (dtype, fp8, H, Hkv, D, num_splits, block_s) in enumerate(CASES):
    q, k, v, lengths, ks, vs = make_inputs(len(LENGTHS), H, Hkv, S, D, LENGTHS, dtype, fp8, seed=i)
    ref = decode_attention_reference(q, k, v, lengths, k_scales=ks, v_scales=vs)
    out = decode_attention_triton(q, k, v, lengths, k_scales=ks, v_scales=vs, block_s=block_s, num_splits=num_splits)
    case = (str(dtype), fp8, H, Hkv, D, num_splits, block_s)
    assert out.dtype == dtype and out.shape == ref.shape and not out.isnan().any(), case
    err = (out.float() - ref.float()).abs().max().item()
    torch.testing.assert_close(out, ref, **TOLERANCE[dtype], msg=lambda m: f"{case}: {m}")
    v0 = dequantized(v, vs, dtype)[0, :, 0].repeat_interleave(H // Hkv, dim=0)
    assert torch.equal(out[0], v0), case  # length 0: softmax weight exactly 1 on position 0
    print(case, f"max |kernel - reference| = {err:.2e}")

print("OK")
""", r"""
# A sharp softmax (q x 8): skipping the spec's rounding of K_hat/V_hat to bf16 moves these outputs by
# several ulps, so matching the reference here checks the kernel dequantizes as dequantize_kv does.
q, k, v, lengths, ks, vs = make_inputs(len(LENGTHS), 8, 2, S, 64, LENGTHS, bf16, True, seed=42)
q = (q.float() * 8).to(bf16)
ref = decode_attention_reference(q, k, v, lengths, k_scales=ks, v_scales=vs)
unrounded = decode_attention_reference(q.float(), k, v, lengths, k_scales=ks, v_scales=vs).to(bf16)
assert not torch.allclose(unrounded.float(), ref.float(), **TOLERANCE[bf16])  # the check has teeth
for num_splits in (1, 3):
    out = decode_attention_triton(q, k, v, lengths, k_scales=ks, v_scales=vs, block_s=16, num_splits=num_splits)
    torch.testing.assert_close(out, ref, **TOLERANCE[bf16])

# The public function with the backend overridden: validation, default tiles and the split rule
# (132 SMs off-GPU, so this small batch splits).
q, k, v, lengths, ks, vs = make_inputs(3, 8, 2, 200, 128, [199, 0, 120], bf16, True, seed=99)
with use_decode_attention_backend("triton"):
    out = decode_attention(q, k, v, lengths, k_scales=ks, v_scales=vs, sm_scale=0.1)
ref = decode_attention_reference(q, k, v, lengths, k_scales=ks, v_scales=vs, sm_scale=0.1)
torch.testing.assert_close(out, ref, **TOLERANCE[bf16])

# Out-of-range lengths (unchecked on the GPU, where a check is a host sync) are clamped into
# [0, S-1] by both implementations: the kernel never reads outside the rows.
q, k, v, _, ks, vs = make_inputs(2, 8, 2, 40, 64, [39, 39], bf16, True, seed=7)
wild = torch.tensor([-3, 1000])
for num_splits in (1, 3):
    out = decode_attention_triton(q, k, v, wild, k_scales=ks, v_scales=vs, block_s=16, num_splits=num_splits)
    ref = decode_attention_reference(q, k, v, wild, k_scales=ks, v_scales=vs)
    torch.testing.assert_close(out, ref, **TOLERANCE[bf16])
# Power-of-two scales with the scales kept out of the dots (pow2_scales=True): the same math, so the
# same tolerance, across splits and tiles; a q whose elements span 2^-30..2^4 (the fp16 prescale
# keeps every one that matters), and a sharp softmax as above; P V with P as one fp16 term (the default) and
# as hi + lo.
for i, (H, Hkv, D, num_splits, block_s, sharp, p_terms) in enumerate(
        [(8, 2, 128, 1, 32, False, 1), (8, 2, 64, 3, 16, False, 2), (4, 4, 64, 1, 64, True, 1),
         (8, 2, 128, 2, 16, True, 2), (8, 2, 128, 2, 16, True, 1)]):
    q, k, v, lengths, ks, vs = make_inputs(len(LENGTHS), H, Hkv, S, D, LENGTHS, bf16, True, seed=50 + i, pow2=True)
    if sharp:
        q = (q.float() * 8).to(bf16)
    q[1, :, : D // 2] = (q[1, :, : D // 2].float() * 2.0**-30).to(bf16)  # tiny next to O(1)
    ref = decode_attention_reference(q, k, v, lengths, k_scales=ks, v_scales=vs)
    out = decode_attention_triton(q, k, v, lengths, k_scales=ks, v_scales=vs, pow2_scales=True, block_s=block_s,
                                  num_splits=num_splits, p_terms=p_terms)
    case = ("pow2", H, Hkv, D, num_splits, block_s, sharp, p_terms)
    torch.testing.assert_close(out, ref, **TOLERANCE[bf16], msg=lambda m: f"{case}: {m}")
    v0 = dequantized(v, vs, bf16)[0, :, 0].repeat_interleave(H // Hkv, dim=0)
    assert torch.equal(out[0], v0), case
    print(case, f"max |kernel - reference| = {(out.float() - ref.float()).abs().max().item():.2e}")
print("OK")
""", r"""
# A row order (longest first, as the engine passes it) moves programs, never bits.
from jetrl.engine.decode_attention import longest_first
q, k, v, lengths, ks, vs = make_inputs(len(LENGTHS), 8, 2, S, 64, LENGTHS, bf16, True, seed=70, pow2=True)
for pow2, num_splits in ((True, 1), (True, 3), (False, 2)):
    plain = decode_attention_triton(q, k, v, lengths, k_scales=ks, v_scales=vs, pow2_scales=pow2, block_s=16,
                                    num_splits=num_splits)
    ordered = decode_attention_triton(q, k, v, lengths, k_scales=ks, v_scales=vs, pow2_scales=pow2, block_s=16,
                                      num_splits=num_splits, row_order=longest_first(lengths))
    assert torch.equal(plain, ordered), (pow2, num_splits)
# The order itself: the counting kernel is the stable descending argsort (ties, zeros, several programs)
from jetrl.engine.kernels.row_order_triton import longest_first_triton
for n in (1, 7, 64, 200, 300):
    lens = torch.randint(0, 9, (n,)) * 100
    assert torch.equal(longest_first_triton(lens), torch.argsort(lens, descending=True, stable=True)), n
assert longest_first_triton(torch.zeros(0, dtype=torch.int64)).shape == (0,)
lens = torch.tensor([5, 0, 1, 0, 9, 0, 3, 0])[::2]  # a strided view
assert torch.equal(longest_first_triton(lens), torch.argsort(lens, descending=True, stable=True))
# fp16 models take the same path; fp32 ones keep the in-loop dequantization (q is not exact in fp16)
for dtype in (fp16, fp32):
    q, k, v, lengths, ks, vs = make_inputs(len(LENGTHS), 8, 2, S, 64, LENGTHS, dtype, True, seed=60, pow2=True)
    ref = decode_attention_reference(q, k, v, lengths, k_scales=ks, v_scales=vs)
    out = decode_attention_triton(q, k, v, lengths, k_scales=ks, v_scales=vs, pow2_scales=True, block_s=16,
                                  num_splits=2)
    torch.testing.assert_close(out, ref, **TOLERANCE[dtype], msg=lambda m: f"pow2 {dtype}: {m}")
print("OK")
""", r"""
# o_proj's FP8 input written in the epilogue (D = 128: a head is a 1x128 group), by the attention kernel
# (1 split) or by the merge (3): quantize()'s codes and scales of the output, bit for bit, in the buffers'
# layout (contiguous codes, column-major scales as the producer slots allocate them)
from jetrl.fp8.quant import quantize
from jetrl.models.fused import QuantizedOutput
# (a BF16 cache in one split quantizes after the kernel: the wrapper's rule; same result)
for i, (fp8, pow2_cache, pow2, num_splits) in enumerate([(True, True, False, 1), (True, True, True, 3),
                                                          (True, False, True, 1), (True, False, False, 2),
                                                          (False, False, True, 1), (False, False, False, 2)]):
    B, H = len(LENGTHS), 8
    q, k, v, lengths, ks, vs = make_inputs(B, H, 2, S, 128, LENGTHS, bf16, fp8, seed=80 + i, pow2=pow2_cache)
    q[2] = q[2] * 40  # a sharp row: other code magnitudes
    codes = torch.full((B, H * 128), float("nan")).to(torch.float8_e4m3fn)
    scales = torch.full((H, B), -1.0).t()
    out = decode_attention_triton(q, k, v, lengths, k_scales=ks, v_scales=vs, pow2_scales=pow2_cache, block_s=16,
                                  num_splits=num_splits, quantized=QuantizedOutput(codes, scales, pow2))
    ref = quantize(out.reshape(B, -1), (1, 128), pow2_scale=pow2)
    assert torch.equal(codes.view(torch.uint8), ref.codes.view(torch.uint8)), (fp8, pow2, num_splits)
    assert torch.equal(scales, ref.scales), (fp8, pow2, num_splits)
    plain = decode_attention_triton(q, k, v, lengths, k_scales=ks, v_scales=vs, pow2_scales=pow2_cache, block_s=16,
                                    num_splits=num_splits)
    assert torch.equal(plain, out), (fp8, pow2, num_splits)  # the epilogue changes nothing else
print("OK")
"""]


def test_kernel_matches_reference_in_interpreter():
    pytest.importorskip("triton")
    run_interpreted(*(KERNEL_PREAMBLE + script for script in KERNEL_SCRIPTS))
