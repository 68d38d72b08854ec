"""What the Mosaic GPU kernels share (`mgpu_paged_attention.py`, `mgpu_w8_matmul.py`): the SMEM
layout that wgmma and TMA both read."""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

SWIZZLE = 128  # bytes: rows of up to 128 bytes swizzled, the layout wgmma and TMA share


def tiled_smem(shape, dtype):
    """An SMEM scratch of `shape` in the swizzled layout wgmma and TMA share: 8-row tiles whose
    rows of up to 128 bytes are swizzled (a narrower row, e.g. 64 int8 columns, swizzles its own
    width)."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = min(SWIZZLE, shape[-1] * itemsize)
    return plgpu.SMEM(
        shape,
        dtype,
        transforms=(
            plgpu.TilingTransform((8, swizzle // itemsize)),
            plgpu.SwizzleTransform(swizzle),
        ),
    )
