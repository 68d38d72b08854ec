"""Tuning configurations of the paged-attention kernels, frozen so they can be static jit arguments:
the Triton kernels' (`DecodeConfig`, `PrefillConfig`) and the Mosaic GPU kernels'
(`MgpuDecodeConfig`, `MgpuPrefillConfig`, below them).

The Triton defaults target the NVIDIA H200 (132 SMs, 228 KB shared memory per SM, ~4.8 TB/s HBM3e):

Decode is bandwidth bound: every KV byte is read once per step and the arithmetic (a 16-row dot
per page block) is negligible. What matters is keeping enough loads in flight on every SM:

* ``block_k = 128`` keys per inner iteration: at head_dim 128 in bf16 a K tile and a V tile are
  32 KB each, so with ``num_stages = 2`` the pipeline holds 128 KB of shared memory, under the
  228 KB an SM has, leaving room for a second resident program. Smaller tiles (64) halve the bytes
  in flight per program; larger ones (256) no longer fit two stages of K and V.
* ``target_programs = 528`` (4 per SM): flash-decoding splits each row's pages over programs until
  batch x KV heads x splits reaches this, so batch 8 at 8 KV heads (64 programs) still fills the
  chip with 8 splits, while batch 64+ needs no split at all (no partial-output traffic).
* ``num_warps = 4``: one warp group per 16-row dot; more warps only add reduction overhead for a
  16 x 128 tile.
* ``min_group_rows = 16``: the query heads sharing a KV head (1..8 for the supported models) are
  padded to 16 rows because Triton's ``tl.dot`` needs M >= 16 (wgmma/mma tiles); the padding costs
  FLOPs that are free in a bandwidth-bound kernel and no extra KV traffic.

Prefill is compute bound at long chunks: ``block_rows = 64`` query rows (tokens x padded head
group) against ``block_k = 64`` keys per iteration is the classic FlashAttention-2 tile for
head_dim 128 on Hopper with the Triton backend (num_warps 4, num_stages 2).

These are starting points chosen from the hardware numbers above, not yet measured on an H200:
``experiments/gpu_kernels.py`` times them. The Mosaic GPU defaults (`H100_MGPU_*`, an H100 or H200
block: 227 KiB of SMEM, 132 SMs) were chosen from the hardware numbers and the ptxas register
counts in each kernel's docstring, not yet timed on a GPU either.
"""

from __future__ import annotations

import dataclasses


def _check_pow2(obj, *fields: str) -> None:
    for f in fields:
        v = getattr(obj, f)
        if not isinstance(v, int) or v <= 0 or v & (v - 1):
            raise ValueError(f"{type(obj).__name__}.{f} must be a positive power of two, got {v!r}")


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Tiles of the flash-decoding kernel (`pallas_kernels.attention.triton_decode`)."""

    block_k: int = (
        128  # keys per inner iteration (a whole number of pages: max(block_k, page_size))
    )
    target_programs: int = 528  # split pages over programs until B * KVH * splits reaches this
    max_splits: int = 16  # upper bound on the split-K factor
    min_group_rows: int = 16  # query-head group padded to at least this many rows (tl.dot M >= 16)
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        _check_pow2(self, "block_k", "max_splits", "min_group_rows", "num_warps")
        if self.target_programs <= 0 or self.num_stages <= 0:
            raise ValueError("DecodeConfig.target_programs and num_stages must be positive")


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """Tiles of the ragged chunked-prefill kernel (`pallas_kernels.attention.triton_prefill`)."""

    block_rows: int = 64  # query rows per program: tokens x padded head group
    block_k: int = 64  # keys per inner iteration (a whole number of pages: max(block_k, page_size))
    min_rows: int = 16  # never fewer rows than this per program (tl.dot M >= 16)
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        _check_pow2(self, "block_rows", "block_k", "min_rows", "num_warps")
        if self.num_stages <= 0:
            raise ValueError("PrefillConfig.num_stages must be positive")
        if self.min_rows > self.block_rows:
            raise ValueError("PrefillConfig.min_rows must not exceed block_rows")


H200_DECODE = DecodeConfig()
H200_PREFILL = PrefillConfig()


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
