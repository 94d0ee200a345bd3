"""Tile configuration and operand contract of the Gluon block-FP8 GEMM (kernels/gemm_gluon.py),
importable without Triton.

The dispatcher (jetrl/fp8/gemm.py) picks a configuration per shape and checks the operands on any
machine; only the kernel module needs Triton with Gluon.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 128  # K per scale group
K_MULTIPLE = 2 * GROUP  # the kernel takes groups in pairs


@dataclass(frozen=True)
class GluonConfig:
    """One CTA's output tile and its pipeline.

    block_m: 64 rows (one consumer warpgroup) or 128 (two, in warp-specialized partitions of their own).
    block_n: 32, 64 or 128 (one weight scale per tile and group needs block_n to divide 128; 32 gives a
             narrow layer twice the CTAs of 64 at M <= 64, where the GEMM streams the weight).
    stages: shared-memory ring slots, each one 128-wide group of K of A and B.
    unroll: groups per consumer loop iteration, 2 or 4 (4 needs K a multiple of 512; else 2 is used).
    """

    block_m: int = 64
    block_n: int = 128
    stages: int = 4
    unroll: int = 2

    def __post_init__(self):
        if self.block_m not in (64, 128) or self.block_n not in (32, 64, 128) or self.unroll not in (2, 4):
            raise ValueError(f"GluonConfig: block_m must be 64 or 128, block_n 32, 64 or 128 and unroll 2 or 4, "
                             f"got {self}")
        if not 2 <= self.stages <= 12:
            raise ValueError(f"GluonConfig: stages must be in [2, 12], got {self.stages}")


def operand_problem(a_codes: torch.Tensor, b_codes: torch.Tensor) -> str | None:
    """Why the kernel cannot take these (M, K) and (N, K) codes, or None: K must be a multiple of 256
    (groups come in pairs) and TMA must read both (unit column stride, 16-byte aligned base and rows)."""
    k = a_codes.shape[1]
    if k % K_MULTIPLE:
        return f"K must be a multiple of {K_MULTIPLE}, got an {tuple(a_codes.shape)} x {tuple(b_codes.shape)} GEMM"
    return tma_problem("a", a_codes) or tma_problem("b", b_codes)


def tma_problem(name: str, codes: torch.Tensor) -> str | None:
    """Why TMA cannot read these codes (unit column stride, 16-byte aligned base and row stride), or None."""
    if codes.stride(1) != 1 or codes.data_ptr() % 16 or codes.stride(0) % 16:
        return (f"TMA reads {name}'s codes: they need unit column stride and a 16-byte aligned base and row "
                f"stride (got strides {tuple(codes.stride())}); pass .contiguous() codes")
    return None
