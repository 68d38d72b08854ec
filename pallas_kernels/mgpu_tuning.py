"""Tuning configurations of the Mosaic GPU kernels, frozen so they can be static jit arguments: the
paged decode (`mgpu_paged_attention.py`) and prefill (`mgpu_paged_prefill.py`) attention kernels.
`H100_*` are the defaults the engine runs (an H100 or H200 block: 227 KiB of SMEM, 132 SMs), chosen
from the hardware numbers and the ptxas register counts in each kernel's docstring, not yet timed
on a GPU. The Triton kernels' configurations are in `tuning.py`.
"""

from __future__ import annotations

import dataclasses


def _check_ring(config) -> None:
    """The key tiles and SMEM ring both attention kernels walk (`mgpu_common.KVRing`)."""
    if config.block_k <= 0 or config.block_k % 64 or config.block_k & (config.block_k - 1):
        raise ValueError(f"block_k must be a power of two multiple of 64, got {config.block_k}")
    if config.num_buffers < 2:
        raise ValueError(f"num_buffers must be >= 2, got {config.num_buffers}")


@dataclasses.dataclass(frozen=True)
class MgpuDecodeConfig:
    """Tiles of the Mosaic GPU decode kernel.

    block_k:         keys per step (a whole number of pages; a multiple of 64, the swizzled K
                     dimension of the P . V product)
    num_buffers:     slots of the K/V SMEM ring (>= 2: NBUF - 1 tiles in flight)
    target_programs: split the pages over programs until B * KVH * splits reaches this (132 SMs)
    max_splits:      upper bound on the split-K factor
    """

    block_k: int = 64
    num_buffers: int = 2
    target_programs: int = 528
    max_splits: int = 16

    def __post_init__(self):
        _check_ring(self)
        if self.target_programs <= 0 or self.max_splits <= 0:
            raise ValueError("target_programs and max_splits must be positive")


@dataclasses.dataclass(frozen=True)
class MgpuPrefillConfig:
    """Tiles of the Mosaic GPU prefill kernel.

    block_k:     keys per step (a whole number of pages; a power of two multiple of 64, the
                 swizzled K dimension of the P . V product)
    num_buffers: slots of the K/V SMEM ring (>= 2). 2 at head_dim 128: 88 KiB of SMEM, two
                 blocks per SM, one's softmax overlapping the other's wgmma.
    """

    block_k: int = 64
    num_buffers: int = 2

    def __post_init__(self):
        _check_ring(self)


H100_MGPU_DECODE = MgpuDecodeConfig()
H100_MGPU_PREFILL = MgpuPrefillConfig()
