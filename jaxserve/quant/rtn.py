"""Round-to-nearest (RTN) group-wise INT4 quantization: w f32[..., K, N] -> (codes, scales, mins).

Groups are `group_size` consecutive inputs (rows of W[K, N]) of one output column, as in the packed
layout (`int4.py`). Scales and mins are rounded to their stored precision (f16) BEFORE the codes
are computed, so `int4.pack(*quantize_rtn(w, g), g)` dequantizes to exactly what RTN chose.

    symmetric:  scale = max(-min(w) / 8, max(w) / 7)   codes = clip(round(w / scale) + 8, 0, 15)
                min = -8 * scale     (zero is exact; the grid is q - 8 in -8..7; the extra negative
                                      level is used when the negative side is the larger one)
    asymmetric: scale = (max(w) - min(w)) / 15         codes = clip(round((w - min) / scale), 0, 15)
                min = min(w)         (GGUF Q4_1 style: a float offset, not an integer zero point)

An all-equal group gets scale 1 so codes stay finite (its values are still exact: min or 0).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxserve.quant import int4


def _grouped(w: jax.Array, group_size: int) -> jax.Array:
    """[..., K, N] -> [..., K/g, g, N]."""
    *lead, k, n = w.shape
    if k % group_size:
        raise ValueError(f"input dim K={k} is not a multiple of group_size={group_size}")
    return w.reshape(*lead, k // group_size, group_size, n)


@functools.partial(jax.jit, static_argnames=("group_size", "symmetric"))
def quantize_rtn(
    w: jax.Array, group_size: int = int4.DEFAULT_GROUP_SIZE, symmetric: bool = True
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """w[..., K, N] -> (codes u8[..., K, N], scales f32[..., K/g, N], mins f32[..., K/g, N])."""
    wg = _grouped(w.astype(jnp.float32), group_size)  # (..., G, g, N)
    lo = jnp.min(wg, axis=-2)  # (..., G, N)
    hi = jnp.max(wg, axis=-2)
    if symmetric:
        scale = jnp.maximum(-lo / 8.0, hi / 7.0)
        scale = int4.to_stored(jnp.where(scale > 0, scale, 1.0))
        mins = -8.0 * scale  # exact in f16 (a power-of-two multiple)
        q = jnp.round(wg / scale[..., None, :]) + 8.0
    else:
        mins = int4.to_stored(lo)
        scale = int4.to_stored(jnp.where(hi > lo, (hi - lo) / 15.0, 1.0))
        q = jnp.round((wg - mins[..., None, :]) / scale[..., None, :])
    codes = jnp.clip(q, 0, 15).astype(jnp.uint8).reshape(w.shape)
    return codes, scale, mins


def quantize_int4_rtn(
    w: jax.Array, group_size: int = int4.DEFAULT_GROUP_SIZE, symmetric: bool = True
) -> int4.Int4Weight:
    """w[..., K, N] -> packed Int4Weight by RTN."""
    codes, scales, mins = quantize_rtn(w, group_size, symmetric)
    return int4.pack(codes, scales, mins, group_size)
