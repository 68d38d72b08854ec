"""RMSNorm, computed in f32 and cast back (as Hugging Face's LlamaRMSNorm does)."""

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x[..., D] * rsqrt(mean(x^2) + eps) * weight[D]."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * y).astype(x.dtype)
