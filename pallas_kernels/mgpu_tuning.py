"""Tuning configurations of the Mosaic GPU matmuls, frozen so they can be static jit arguments: the
W8A16 (`mgpu_w8_matmul.py`) and W4A16 (`mgpu_w4_matmul.py`) kernels. `H100_*` are the defaults the
engine runs (an H100 or H200 block: 227 KiB of SMEM, 132 SMs), chosen from the hardware numbers and
the ptxas register counts in each kernel's docstring, not yet timed on a GPU. The attention
kernels' configurations, Triton and Mosaic GPU, are in `attention/tuning.py`.
"""

from __future__ import annotations

import dataclasses

from pallas_kernels.w8_matmul import NUM_SMS


def _check_k_steps(config) -> None:
    """The K steps, ring and split-K both matmul kernels share."""
    if config.block_k not in (64, 128):
        raise ValueError(f"block_k must be 64 or 128, got {config.block_k}")
    if config.num_buffers < 2:
        raise ValueError(f"num_buffers must be >= 2, got {config.num_buffers}")
    if config.splits is not None and config.splits <= 0:
        raise ValueError(f"splits must be positive, got {config.splits}")
    if config.target_programs <= 0 or config.max_splits <= 0:
        raise ValueError("target_programs and max_splits must be positive")


@dataclasses.dataclass(frozen=True)
class MgpuW8Config:
    """Tiles of the Mosaic GPU W8A16 kernel.

    block_n:         output columns a program computes (wgmma N: 64, 128 or 256; must divide
                     N); None: 128 where it divides N, else 64
    block_k:         rows of K a step (64 or 128; 64 where 128 does not divide K)
    num_buffers:     slots of the x / weight SMEM ring (>= 2: NBUF - 1 tiles in flight)
    splits:          split-K factor (must divide K / block_k); None: `plan` picks it
    target_programs: with splits=None, split until the grid has this many programs (two per SM)
    max_splits:      with splits=None, the largest split-K factor `plan` picks
    """

    block_n: int | None = None
    block_k: int = 128
    num_buffers: int = 2
    splits: int | None = None
    target_programs: int = 2 * NUM_SMS
    max_splits: int = 16

    def __post_init__(self):
        if self.block_n not in (None, 64, 128, 256):
            raise ValueError(f"block_n must be 64, 128 or 256, got {self.block_n}")
        _check_k_steps(self)


@dataclasses.dataclass(frozen=True)
class MgpuW4Config:
    """Tiles of the Mosaic GPU W4A16 kernel.

    block_c:         packed columns a program computes (16 or 32: 8*block_c outputs; N/8 must be
                     a multiple); None: 32 where it divides N/8, else 16
    block_k:         rows of K a step (64 or 128; 64 where 128 does not divide K; 128 spills
                     at block_c 32)
    num_buffers:     slots of the x / packed / scales SMEM ring (>= 2: NBUF - 1 steps in flight)
    splits:          split-K factor (must divide K / block_k); None: `plan` picks it
    target_programs: with splits=None, split until the grid has this many programs (two per SM)
    max_splits:      with splits=None, the largest split-K factor `plan` picks
    """

    block_c: int | None = None
    block_k: int = 64
    num_buffers: int = 3
    splits: int | None = None
    target_programs: int = 2 * NUM_SMS
    max_splits: int = 16

    def __post_init__(self):
        if self.block_c not in (None, 16, 32):
            raise ValueError(f"block_c must be 16 or 32, got {self.block_c}")
        _check_k_steps(self)


H100_MGPU_W8 = MgpuW8Config()
H100_MGPU_W4 = MgpuW4Config()
