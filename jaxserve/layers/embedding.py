"""Token embedding lookup over a plain or quantized table.

A table is either a plain array `[V, D]` (a row gather) or a quantized weight from `jaxserve.quant`
stored in the "lm_head view": logical shape `[D, V]` (in = D, out = V), so that the one object also
serves tied logits as `linear(hidden, table)`. Its lookup gathers columns, `table.take(ids)`,
which unpacks only the B*T gathered columns (never the whole table):

    plain:      table[V, D][tokens]                 -> [B, T, D]
    quantized:  table[D, V].take(tokens)  = W[:, tokens].T -> [B, T, D]

Why the lm_head view rather than a row-major quantized table: the logits matmul reads the whole
table every decode step and is the bandwidth-bound hot path, so it gets the layout the INT4/INT8
matmul kernels want; the lookup touches only B*T columns, so a strided column gather costs little.
"""

import jax
import jax.numpy as jnp
import numpy as np


def is_quantized(w) -> bool:
    """True for a quantized-weight pytree (it multiplies itself: `w.matmul(x)`), False for arrays."""
    return hasattr(w, "matmul") and hasattr(w, "take")


def embed(table, tokens: jax.Array, dtype) -> jax.Array:
    """tokens i32[B, T] -> embeddings [B, T, D] in dtype.

    table: a plain array [V, D], or a quantized weight of logical shape [D, V] with `.take`.
    """
    if isinstance(table, jax.Array | np.ndarray):
        return jnp.asarray(table)[tokens].astype(dtype)  # (B, T, D)
    if not is_quantized(table):
        raise ValueError(
            f"embedding table must be an array [V, D] or a quantized weight [D, V] with .take(), "
            f"got {type(table).__name__}"
        )
    return table.take(tokens, dtype)  # (B, T, D)
