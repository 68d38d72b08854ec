"""RMSNorm, computed in f32 and cast back (as Hugging Face's LlamaRMSNorm and Gemma's RMSNorm do).

The mean of squares is summed in one fixed order (`row_sum`), not by XLA's reduce: on the CPU,
XLA's f32 reduce over a row of 576 gives other bits for the same row when the call holds 8 or more
rows than when it holds fewer (its vectorization changes), so a lone request's decode steps (1-row
bucket) and the same request's in an 8-row step differed, and greedy SmolLM2 bf16 tokens changed
with the batch (experiments/JOURNAL.md 52c). Elementwise adds in a written order are not
reassociated, so a row's norm never depends on the other rows.
"""

import jax
import jax.numpy as jnp

LANES = 16  # columns summed side by side; then the lanes are halved pairwise


def row_sum(x: jax.Array) -> jax.Array:
    """sum(x, axis=-1) in one fixed order whatever the leading dims: chunks of LANES columns added
    left to right (the last chunk zero-padded), then the LANES partial sums halved pairwise."""
    d = x.shape[-1]
    pad = -d % LANES
    if pad:
        x = jnp.concatenate([x, jnp.zeros((*x.shape[:-1], pad), x.dtype)], axis=-1)
    chunks = x.reshape(*x.shape[:-1], -1, LANES)
    acc = chunks[..., 0, :]
    for i in range(1, chunks.shape[-2]):
        acc = acc + chunks[..., i, :]
    while acc.shape[-1] > 1:
        half = acc.shape[-1] // 2
        acc = acc[..., :half] + acc[..., half:]
    return acc[..., 0]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """x[..., D] * rsqrt(mean(x^2) + eps) * (offset + weight[D]).

    offset (static): 0 for Llama-style norms, 1 for Gemma's, which store weight - 1 (HF's
    `GemmaRMSNorm`: `(1 + w)` in f32).
    """
    xf = x.astype(jnp.float32)
    mean_sq = row_sum(xf * xf)[..., None] / xf.shape[-1]
    y = xf * jax.lax.rsqrt(mean_sq + eps)
    w = weight.astype(jnp.float32)
    if offset:
        w = offset + w
    return (w * y).astype(x.dtype)
