"""SASS per key tile of exact mode's attention loop, by path, compiled for sm_90 on this machine (no GPU needed).

The kernel (jetrl/models/kernels/exact_attention_triton.py) takes its cache kind (FP8_KV), "no mask" (HAS_MASK) and
each tile's partial/full choice at run time, so its compiled loop holds every path at once. To count what one path
executes, this script compiles a temporary copy of the kernel's source in which those choices are compile-time
constants (the copy is never launched; the shipped kernel is one binary). It compiles as a launch does (fp fusion
off) and prints the loop's instruction count and mix per path and warp count (jetrl/bench/sass.py says how).

    python bench/sass_exact_attention.py          # needs Triton (the CPU wheel is fine)
"""

import importlib.util
import inspect
import re
import sys
import tempfile

import torch

from jetrl.bench.sass import compile_like_launch, loop_mixes
from jetrl.models.kernels import exact_attention_triton

SUBSTITUTIONS = (  # runtime flags -> constexprs, in the copy only
    ('"sms", "FP8_KV", "CACHE_LENGTHS", "HAS_MASK")', '"sms")'),
    ("sms, FP8_KV, CACHE_LENGTHS, HAS_MASK,\n",
     "sms, FP8_KV: tl.constexpr, CACHE_LENGTHS: tl.constexpr, HAS_MASK: tl.constexpr, PARTIAL: tl.constexpr,\n"),
    ("def _kv_tile(x_ptr, codes_ptr, scales_ptr, kv_row, j, d, j_ok, FP8_KV,",
     "def _kv_tile(x_ptr, codes_ptr, scales_ptr, kv_row, j, d, j_ok, FP8_KV: tl.constexpr,"),
)
PARTIAL = re.compile(r"partial = \(HAS_MASK != 0\).*\n")


def path_module():
    source = inspect.getsource(exact_attention_triton)
    for old, new in SUBSTITUTIONS:
        if old not in source:
            raise SystemExit(f"the kernel's source changed; update SUBSTITUTIONS ({old!r} not found)")
        source = source.replace(old, new)
    source, count = PARTIAL.subn("partial = PARTIAL\n", source)
    if count != 1:
        raise SystemExit("the kernel's source changed; update PARTIAL")
    with tempfile.NamedTemporaryFile("w", suffix="_exact_attention_paths.py", delete=False) as path:
        path.write(source)
    spec = importlib.util.spec_from_file_location("exact_attention_paths", path.name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # Triton reads the jitted functions' globals through it
    spec.loader.exec_module(module)
    return module


def main() -> None:
    module = path_module()
    bf16, u8, f32 = (torch.empty(1, dtype=t) for t in (torch.bfloat16, torch.uint8, torch.float32))
    args = {"q_ptr": bf16, "k_ptr": bf16, "v_ptr": bf16, "kc_ptr": u8, "vc_ptr": u8, "ks_ptr": f32, "vs_ptr": f32,
            "len_ptr": torch.empty(1, dtype=torch.int64), "mask_ptr": u8, "out_ptr": bf16, "T": 3, "S": 3, "G": 3,
            "HKV": 3, "qk_scale": 0.5, "shift": 3, "smb": 3, "smt": 3, "sms": 3}
    tiles = exact_attention_triton.TILES
    paths = {"BF16 cache, full tile": (0, 0, 0), "BF16 cache, partial tile": (0, 0, 1),
             "BF16 cache, through a mask": (0, 1, 1), "FP8 cache, full tile": (1, 0, 0),
             "FP8 cache, partial tile": (1, 0, 1)}
    for warps in (1, 2, 4):
        for label, (fp8, has_mask, partial) in paths.items():
            constexprs = {"D": 128, "BLOCK_M": tiles["BLOCK_M"], "BLOCK_N": tiles["BLOCK_N"], "EMULATE": False,
                          "FP8_KV": fp8, "CACHE_LENGTHS": 1, "HAS_MASK": has_mask, "PARTIAL": bool(partial)}
            compiled = compile_like_launch(module._exact_attention_kernel, args, constexprs, num_warps=warps,
                                           num_stages=tiles["num_stages"], enable_fp_fusion=False)
            for loop in loop_mixes(compiled):
                top = ", ".join(f"{op} {n}" for op, n in loop.mix.most_common(8))
                print(f"{warps} warps, {label:28s} {loop.count:5d} instructions per tile: {top}")


if __name__ == "__main__":
    main()
