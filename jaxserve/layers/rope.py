"""Rotary position embedding in Hugging Face's rotate-half layout (first half / second half pairs)."""

import jax
import jax.numpy as jnp
import numpy as np


def apply_rope(
    x: jax.Array,
    positions: jax.Array,
    inv_freq,
    *,
    long_inv_freq: np.ndarray | None = None,
    long_from: int | None = None,
    scale: float = 1.0,
) -> jax.Array:
    """x: [B, T, N, D], positions: i32[B, T], inv_freq: f32[D/2] (numpy, or traced when it is
    scanned per layer) -> [B, T, N, D] in x.dtype.

    LongRoPE (Phi-3): positions >= long_from use long_inv_freq instead; cos and sin are multiplied
    by `scale` (its attention factor). Both are static.
    """
    pos = positions.astype(jnp.float32)[..., None]  # (B, T, 1)
    freq = jnp.asarray(inv_freq, jnp.float32)  # (D/2,)
    if long_inv_freq is not None:
        long = (positions >= long_from)[..., None]  # (B, T, 1)
        freq = jnp.where(long, jnp.asarray(long_inv_freq, jnp.float32), freq)  # (B, T, D/2)
    angles = pos * freq  # (B, T, D/2)
    cos = jnp.cos(angles)[:, :, None, :]  # (B, T, 1, D/2)
    sin = jnp.sin(angles)[:, :, None, :]
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
