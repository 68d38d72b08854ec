"""Rotary position embedding in Hugging Face's rotate-half layout (first half / second half pairs)."""

import jax
import jax.numpy as jnp
import numpy as np


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """x: [B, T, N, D], positions: i32[B, T], inv_freq: f32[D/2] -> [B, T, N, D] in x.dtype."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # (B, T, D/2)
    cos = jnp.cos(angles)[:, :, None, :]  # (B, T, 1, D/2)
    sin = jnp.sin(angles)[:, :, None, :]
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
