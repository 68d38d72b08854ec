"""Linear layers over plain or quantized weights.

A weight is either a plain array `[in, out]` (x @ w) or a quantized weight pytree from
`jaxserve.quant` that knows how to multiply itself (`w.matmul(x)`). Layers never look inside a
quantized weight: the packed layout is defined once, in `jaxserve/quant/`.
"""

import math

import jax
import jax.numpy as jnp

MIN_CPU_ROWS = 4  # see `matmul`


def matmul(x: jax.Array, w: jax.Array, *, transposed: bool = False, out_dtype=None) -> jax.Array:
    """x[..., in] @ w -> [..., out]; w is [in, out], or [out, in] with `transposed`.

    out_dtype: the dot's result type (e.g. f32 accumulation for logits); default x.dtype.

    On CPU fewer than MIN_CPU_ROWS rows are padded up to it (zero rows, sliced off after):
    - XLA's CPU backend sends a one-row bf16 dot to a generic emitter that first converts the
      whole weight to f32; SmolLM2's tied logits for one prefill chunk took 43 ms as one row and
      4 ms as two (`experiments/RESULTS.md` section 17);
    - from 4 rows up its GEMM gives a row the same bits whatever the other rows (section 16), so
      a one-chunk prefill samples its first token from the same logits as a chunk among others.
    A padded dot costs what the unpadded one does: these shapes are bound by reading the weight.
    """
    x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    m = x2.shape[0]
    if m < MIN_CPU_ROWS and jax.default_backend() == "cpu":
        x2 = jnp.pad(x2, ((0, MIN_CPU_ROWS - m), (0, 0)))
    spec = "ni,oi->no" if transposed else "ni,io->no"
    y = jnp.einsum(spec, x2, w, preferred_element_type=out_dtype)[:m]
    return y.reshape(*x.shape[:-1], y.shape[-1])


def linear(x: jax.Array, w, layer=None) -> jax.Array:
    """x[..., in] @ w[in, out] -> [..., out] in x.dtype.

    layer (i32[] or int): w is a stack [L, in, out] and the weight is its layer `layer`. A
    quantized weight whose kernel reads a stack's layer in place (`reads_layer_in_place`: INT4)
    gets the stack whole; any other weight is sliced out here.
    """
    if layer is not None and not getattr(w, "reads_layer_in_place", False):
        w = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, layer, keepdims=False), w)
        layer = None
    if isinstance(w, jax.Array):
        return matmul(x, w.astype(x.dtype))
    return w.matmul(x) if layer is None else w.matmul(x, layer=layer)
