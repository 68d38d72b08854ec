"""What the Mosaic GPU kernels share (the attention kernels, `attention/mgpu_*.py`, and the
matmuls, `mgpu_w8_matmul.py`, `mgpu_w4_matmul.py`): the SMEM layout that wgmma and TMA both read,
the wgmma M tile and a Hopper block's SMEM, and the question their callers ask of each one's input
check; the row blocks and split-K of the matmuls. The attention kernels' own ring, softmax step and
input check are in `attention/mgpu_common.py`."""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

SWIZZLE = 128  # bytes: rows of up to 128 bytes swizzled, the layout wgmma and TMA share
ROWS = 64  # wgmma M tile (the attention kernels pad a KV head's query rows to it)
SMEM_BYTES = 227 * 1024  # dynamic shared memory of one H100/H200 block


def swizzled_smem(shape, dtype, swizzle: int):
    """An SMEM scratch of `shape` in the layout TMA and wgmma share: 8-row tiles of `swizzle`-byte
    rows, swizzled."""
    return plgpu.SMEM(
        shape,
        dtype,
        transforms=(
            plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
            plgpu.SwizzleTransform(swizzle),
        ),
    )


def tiled_smem(shape, dtype):
    """An SMEM scratch of `shape` in the swizzled layout wgmma and TMA share: 8-row tiles whose
    rows of up to 128 bytes are swizzled (a narrower row, e.g. 64 int8 columns, swizzles its own
    width)."""
    return swizzled_smem(shape, dtype, min(SWIZZLE, shape[-1] * jnp.dtype(dtype).itemsize))


def accepts(check, *args, **kwargs) -> bool:
    """Whether a Mosaic GPU kernel's input check (`check_mgpu_*`) passes for these arguments'
    shapes and dtypes: a static, trace-time decision. The engine's 'mgpu' implementations run
    the kernel where this holds and its Triton twin elsewhere."""
    try:
        check(*args, **kwargs)
    except ValueError:
        return False
    return True


# ------------------------------------------------------------------------------------------------
# The matmuls' row blocks and split-K.


def row_blocks(m: int, rows: int = 64) -> tuple[int, int]:
    """(R, Mp): the rows of x one program computes and the padded row count, for a wgmma M tile of
    `rows`: m rounded up to 8 in one block (m <= rows), else to `rows` in blocks of `rows`."""
    if m <= rows:
        r = -(-m // 8) * 8
        return r, r
    return rows, -(-m // rows) * rows


def split_k(steps: int, programs: int, splits, target_programs: int, max_splits: int) -> int:
    """`splits` if given, else the smallest divisor of the K steps that brings `programs` to
    `target_programs` (at most `max_splits`; else the largest divisor under it)."""
    if splits is not None:
        return splits
    divisors = [d for d in range(1, min(steps, max_splits) + 1) if steps % d == 0]
    return next((d for d in divisors if programs * d >= target_programs), divisors[-1])
