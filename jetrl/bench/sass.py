"""Static instruction counts of a Triton kernel's loops on Hopper, compiled without a GPU.

Why: the decode kernels here are bound by instruction issue and latency as often as by bytes, and
GPU time is scarce. Triton ships ptxas and cuobjdump, so a kernel can be compiled for sm_90 on
any machine and the SASS of its inner loop counted: per tile, how many instructions, of which
kinds (tensor-core ``HMMA``, conversions, shared-memory loads such as the byte-wise ``LDS.U8``
that made the first FP8 decode attention slow). That count predicted, before any GPU run, the
rewrite measured in docs/benchmarks.md section (d): 1121 -> 690 instructions per tile, 184 ->
92 µs on the H200. It is a guide, not a timing: latency and occupancy are not in it.

The compile must see what a real launch sees, or the code differs (an unspecialized stride of 1
loses vectorized loads): :func:`compile_like_launch` specializes each argument with Triton's own
launch-time rule (an int equal to 1 becomes a constexpr; ints and pointers divisible by 16 get the
divisibility hint), given example arguments -- small tensors of the right dtype for pointers,
the real ints for shapes and strides.

    compiled = compile_like_launch(kernel, args, constexprs, num_warps=1, num_stages=3)
    for loop in loop_mixes(compiled):        # backward branches in the SASS, outermost first
        print(loop.count, loop.mix.most_common(8))

Needs Triton (its bundled ``cuobjdump``); imported lazily by callers.
"""

from __future__ import annotations

import collections
import inspect
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Any

SM90 = 90
_INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]{4,6})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA\s+(?:`\()?0x([0-9a-f]+)")
_PREDICATE = re.compile(r"^@!?U?P\w+\s+")


@dataclass(frozen=True)
class LoopMix:
    """One loop of the SASS: addresses [start, end] (the backward branch) and its instructions by opcode."""

    start: int
    end: int
    mix: collections.Counter

    @property
    def count(self) -> int:
        return sum(self.mix.values())


def compile_like_launch(fn, args: dict[str, Any], constexprs: dict[str, Any], *, num_warps: int, num_stages: int,
                        arch: int = SM90, **options: Any):
    """Compile Triton kernel ``fn`` for sm_90 (or ``arch``) as a launch with ``args`` (name -> tensor / int / float)
    would; ``options``: further compile options of the launch (e.g. ``enable_fp_fusion=False``).

    ``constexprs`` are the kernel's ``tl.constexpr`` parameters (those with a default may be left out);
    every other parameter must be in ``args``. Pointers are represented by tensors of the launch's dtype
    (any size: only the dtype and the 16-byte alignment of the allocation matter).
    """
    import triton
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import native_specialize_impl

    defaults = {p.name: p.default for p in fn.params if p.is_constexpr and p.default is not inspect.Parameter.empty}
    constexprs = {**defaults, **constexprs}  # a launch that leaves a defaulted constexpr out gets its default
    signature, consts, attrs = {}, dict(constexprs), {}
    for index, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        if name not in args:
            raise ValueError(f"compile_like_launch: {fn.__name__} needs argument {name!r}, or a constexpr for it")
        kind, key = native_specialize_impl(BaseBackend, args[name], False, True, True)
        if kind == "constexpr":  # Triton's launch turns an int equal to 1 into a constexpr
            signature[name], consts[name] = "constexpr", key
        else:
            signature[name] = kind
            if key == "D":
                attrs[(index,)] = [["tt.divisibility", 16]]
    if getattr(fn, "is_gluon", lambda: False)():  # a Gluon kernel (gemm_gluon.py) builds its IR its own way
        from triton.experimental.gluon._runtime import GluonASTSource

        source = GluonASTSource(fn, signature, consts, attrs)
    else:
        source = ASTSource(fn, signature, consts, attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages, **options})


def sass(compiled) -> str:
    """The SASS of a compiled kernel, disassembled with Triton's bundled cuobjdump."""
    return _cuobjdump(compiled, "-sass")


def registers(compiled) -> int | None:
    """Registers per thread of a compiled kernel (cuobjdump's resource usage): with the warps per CTA, what bounds
    how many CTAs an SM holds."""
    found = re.search(r"REG:(\d+)", _cuobjdump(compiled, "-res-usage"))
    return int(found.group(1)) if found else None


def _cuobjdump(compiled, flag: str) -> str:
    """Triton's bundled cuobjdump ``flag`` on a compiled kernel's cubin."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout


def loop_mixes(compiled) -> list[LoopMix]:
    """Every loop of the kernel (a branch back to a lower address), by start address: its instructions
    by opcode (predicates stripped, modifiers kept: ``LDS.U8``, ``HMMA.16816.F32``)."""
    instructions = []
    for line in sass(compiled).splitlines():
        match = _INSTRUCTION.match(line)
        if match:
            instructions.append((int(match.group(1), 16), match.group(2)))
    loops = []
    for address, text in instructions:
        branch = _BRANCH.search(text)
        if branch and int(branch.group(1), 16) < address:
            start = int(branch.group(1), 16)
            body = [_PREDICATE.sub("", t).split()[0] for a, t in instructions if start <= a <= address]
            loops.append(LoopMix(start, address, collections.Counter(body)))
    return sorted(loops, key=lambda loop: loop.start)


# ---------------------------------------------------------------------------------------
# Example launches of jetrl's decode kernels (bench/sass_loops.py, tests/test_decode_attention.py).
def decode_attention_args(fp8: bool, B: int = 256, H: int = 32, Hkv: int = 8, S: int = 1152, D: int = 128) -> dict:
    """Arguments of ``_decode_attention_kernel`` as a launch over contiguous (B, Hkv, S, D) caches passes them."""
    import torch

    cache = torch.empty(1, dtype=torch.uint8 if fp8 else torch.bfloat16)
    bf16, f32, i64 = torch.empty(1, dtype=torch.bfloat16), torch.empty(1), torch.empty(1, dtype=torch.int64)
    args = {"q_ptr": bf16, "k_ptr": cache, "v_ptr": cache, "k_scales_ptr": f32, "v_scales_ptr": f32,
            "lengths_ptr": i64, "row_order_ptr": i64, "out_ptr": bf16, "part_out_ptr": f32, "part_lse_ptr": f32,
            "codes_ptr": torch.empty(1, dtype=torch.uint8), "codes_scales_ptr": f32, "stride_csr": 1, "stride_csc": B,
            "num_kv_heads": Hkv, "S": S, "D": D, "qk_scale": 0.1, "stride_lb": 1}
    cache_strides = (Hkv * S * D, S * D, D, 1)
    layouts = {"q": ("bhd", (H * D, D, 1)), "o": ("bhd", (H * D, D, 1)), "k": ("bhsd", cache_strides),
               "v": ("bhsd", cache_strides), "ks": ("bhs", (Hkv * S, S, 1)), "vs": ("bhs", (Hkv * S, S, 1))}
    for name, (suffixes, strides) in layouts.items():
        args.update({f"stride_{name}{suffix}": stride for suffix, stride in zip(suffixes, strides)})
    return args


def gemm_small_m_args(m: int, n: int, k: int) -> dict:
    """Arguments of ``_gemm_small_m_kernel`` for an (m, k) x (n, k)^T GEMM, row-major activation scales."""
    import torch

    codes, f32, bf16 = torch.empty(1, dtype=torch.float8_e4m3fn), torch.empty(1), torch.empty(1, dtype=torch.bfloat16)
    groups = -(-k // 128)
    return {"a_ptr": codes, "sa_ptr": f32, "b_ptr": codes, "sb_ptr": f32, "out_ptr": bf16, "work_ptr": f32,
            "count_ptr": torch.empty(1, dtype=torch.int32), "M": m, "N": n, "K": k, "stride_am": k, "stride_bn": k,
            "stride_sam": groups, "stride_sak": 1, "stride_sbn": groups, "stride_om": n}
