"""Tile configuration of the Gluon block-FP8 GEMM (kernels/gemm_gluon.py), importable without Triton.

The dispatcher (jetrl/fp8/gemm.py) picks a configuration per shape on any machine; only the kernel
module needs Triton with Gluon.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GluonConfig:
    """One CTA's output tile and its pipeline.

    block_m: 64 rows (one consumer warpgroup) or 128 (two, in warp-specialized partitions of their own).
    block_n: 64 or 128 (one weight scale per tile and group needs block_n to divide 128).
    stages: shared-memory ring slots, each one 128-wide group of K of A and B.
    unroll: groups per consumer loop iteration, 2 or 4 (4 needs K a multiple of 512; else 2 is used).
    """

    block_m: int = 64
    block_n: int = 128
    stages: int = 4
    unroll: int = 2

    def __post_init__(self):
        if self.block_m not in (64, 128) or self.block_n not in (64, 128) or self.unroll not in (2, 4):
            raise ValueError(f"GluonConfig: block_m and block_n must be 64 or 128 and unroll 2 or 4, got {self}")
        if not 2 <= self.stages <= 12:
            raise ValueError(f"GluonConfig: stages must be in [2, 12], got {self.stages}")
