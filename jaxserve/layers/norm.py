"""RMSNorm, computed in f32 and cast back (as Hugging Face's LlamaRMSNorm and Gemma's RMSNorm do)."""

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """x[..., D] * rsqrt(mean(x^2) + eps) * (offset + weight[D]).

    offset (static): 0 for Llama-style norms, 1 for Gemma's, which store weight - 1 (HF's
    `GemmaRMSNorm`: `(1 + w)` in f32).
    """
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    w = weight.astype(jnp.float32)
    if offset:
        w = offset + w
    return (w * y).astype(x.dtype)
