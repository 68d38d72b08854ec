"""Linear layers over plain or quantized weights.

A weight is either a plain array `[in, out]` (x @ w) or a quantized weight pytree from
`jaxserve.quant` that knows how to multiply itself (`w.matmul(x)`). Layers never look inside a
quantized weight: the packed layout is defined once, in `jaxserve/quant/`.
"""

import jax
import jax.numpy as jnp


def linear(x: jax.Array, w) -> jax.Array:
    """x[..., in] @ w[in, out] -> [..., out] in x.dtype."""
    if isinstance(w, jax.Array):
        return jnp.einsum("...i,io->...o", x, w.astype(x.dtype))
    return w.matmul(x)
