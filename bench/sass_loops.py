"""SASS instruction mix of the inner loops of jetrl's decode kernels, compiled for sm_90 on this machine
(no GPU): the decode attention at its default tiles per cache kind, and the small-M block-FP8 GEMM at
M = 1, 16, 64 for the four GEMMs of an 8B layer. A guide to where a kernel's issue slots go before
spending GPU time (jetrl/bench/sass.py says how it compiles and what it counts).

    python bench/sass_loops.py          # needs Triton (CPU wheel is fine)
"""

import triton
import triton.language as tl

from jetrl.bench.sass import compile_like_launch, decode_attention_args, gemm_small_m_args, loop_mixes
from jetrl.engine.kernels import decode_attention_triton as attention
from jetrl.fp8.kernels import gemm_triton


def show(label, compiled):
    for loop in loop_mixes(compiled):
        top = ", ".join(f"{op} {n}" for op, n in loop.mix.most_common(12))
        print(f"{label:40s} loop of {loop.count:5d} instructions: {top}")


def main() -> None:
    for kind, (block_s, warps, stages) in attention.DEFAULT_TILES.items():
        fp8 = kind.startswith("fp8")
        constexprs = {"G": 4, "DTYPE": tl.bfloat16, "BLOCK_G": 4, "BLOCK_S": block_s, "BLOCK_D": 128,
                      "NUM_SPLITS": 1, "IS_FP8": fp8, "POW2_SCALES": kind == "fp8 pow2", "ROW_ORDER": True,
                      "EMULATE": False, "P_TERMS": attention.POW2_P_TERMS}
        show(f"decode attention, {kind}, {block_s} positions",
             compile_like_launch(attention._decode_attention_kernel, decode_attention_args(fp8), constexprs,
                                 num_warps=warps, num_stages=stages))
    for name, n, k in (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288)):
        for m in (1, 16, 64):
            cfg = gemm_triton.small_m_config(m, n, k)
            groups = triton.cdiv(k, 128)
            constexprs = {"GROUPS_PER_SPLIT": triton.cdiv(groups, cfg.split_k), "SPLIT_K": cfg.split_k,
                          "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n}
            show(f"small-M GEMM {name} M={m} {cfg.block_m}x{cfg.block_n} split {cfg.split_k}",
                 compile_like_launch(gemm_triton._gemm_small_m_kernel, gemm_small_m_args(m, n, k), constexprs,
                                     num_warps=cfg.num_warps, num_stages=cfg.num_stages))


if __name__ == "__main__":
    main()
