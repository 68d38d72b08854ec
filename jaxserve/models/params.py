"""The model's parameter tree: the logical shape of every parameter (the loaders' and the
partition rules' contract), its check, the activation dtype, and random weights.

    param_shapes(config) -> nested dict of shapes      check_params(params, config)
    model_dtype(params)                                init_params(config, key, dtype)

`models/llama.py` documents the tree's layout and re-exports these names.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.layers.embedding import is_quantized


def param_shapes(config: ModelConfig) -> dict:
    """The logical shape of every parameter, as a nested dict of tuples (the name map's contract).

    embed is (V, D) as a plain array; `check_params` accepts a quantized embed as (D, V).
    """
    c = config
    L, D, I, V = c.num_layers, c.hidden_size, c.intermediate_size, c.vocab_size
    qd, kd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    layers = {
        "attn_norm": (L, D),
        "wq": (L, D, qd),
        "wk": (L, D, kd),
        "wv": (L, D, kd),
        "wo": (L, qd, D),
        "mlp_norm": (L, D),
    }
    # --- mixture-of-experts: each MLP stack holds only the layers of its kind ---
    if c.dense_layers:
        ld = len(c.dense_layers)
        layers.update({"w_gate": (ld, D, I), "w_up": (ld, D, I), "w_down": (ld, I, D)})
    if c.moe_layers:
        ls, e, im = len(c.moe_layers), c.num_experts, c.moe_intermediate_size
        layers.update(
            {
                "router": (ls, D, e),
                "we_gate": (ls, e, D, im),
                "we_up": (ls, e, D, im),
                "we_down": (ls, e, im, D),
            }
        )
    # --- end mixture-of-experts ---
    if c.attention_bias:
        layers.update({"bq": (L, qd), "bk": (L, kd), "bv": (L, kd)})
    if c.qk_norm:
        layers.update({"q_norm": (L, c.head_dim), "k_norm": (L, c.head_dim)})
    if c.sandwich_norms:
        layers.update({"post_attn_norm": (L, D), "post_mlp_norm": (L, D)})
    shapes = {"embed": (V, D), "layers": layers, "final_norm": (D,)}
    if not c.tie_word_embeddings:
        shapes["lm_head"] = (D, V)
    return shapes


def check_params(params: dict, config: ModelConfig) -> None:
    """Raises ValueError naming any missing, unexpected or mis-shaped parameter."""
    want = param_shapes(config)

    def walk(w, p, prefix):
        missing = sorted(set(w) - set(p))
        extra = sorted(set(p) - set(w))
        if missing:
            raise ValueError(f"missing parameter(s): {[prefix + m for m in missing]}")
        if extra:
            raise ValueError(f"unexpected parameter(s): {[prefix + e for e in extra]}")
        for k, shape in w.items():
            if isinstance(shape, dict):
                walk(shape, p[k], prefix + k + "/")
                continue
            shape = tuple(shape)
            if prefix + k == "embed" and is_quantized(p[k]):
                shape = shape[::-1]  # the lm_head view (D, V): see layers/embedding.py
                if tuple(p[k].shape) != shape:
                    raise ValueError(
                        f"parameter embed is a quantized {type(p[k]).__name__} of logical shape "
                        f"{tuple(p[k].shape)}, expected the lm_head view (D, V) = {shape}"
                    )
            elif tuple(p[k].shape) != shape:
                raise ValueError(
                    f"parameter {prefix + k} has shape {tuple(p[k].shape)}, expected {shape}"
                )

    walk(want, params, "")


def model_dtype(params: dict):
    """The dtype activations run in: the float embedding table's, else final_norm's."""
    table = params["embed"]
    return table.dtype if not is_quantized(table) else params["final_norm"].dtype


DRAW_BLOCK = 1 << 24  # elements per f32 draw (64 MiB) when a weight is drawn in row blocks


@functools.partial(jax.jit, static_argnums=(1, 2))
def _normal_leaf(key: jax.Array, shape: tuple[int, ...], dtype) -> jax.Array:
    """0.02 * N(0, 1) of `shape`, drawn in f32 and written in `dtype` by one program. A weight
    of more than DRAW_BLOCK elements is drawn in blocks of rows (key folded with the block
    index) into its `dtype` buffer, so no f32 copy of a whole embedding table is ever held."""
    size = math.prod(shape)
    if size <= DRAW_BLOCK or len(shape) < 2:
        return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    rows = shape[0]
    block = max(1, min(rows, DRAW_BLOCK // (size // rows)))

    def draw(i, out):  # the last block is clamped to end at `rows` (it redraws a few rows)
        x = 0.02 * jax.random.normal(jax.random.fold_in(key, i), (block, *shape[1:]), jnp.float32)
        start = jnp.minimum(i * block, rows - block)
        return jax.lax.dynamic_update_slice_in_dim(out, x.astype(dtype), start, 0)

    return jax.lax.fori_loop(0, -(-rows // block), draw, jnp.zeros(shape, dtype))


def init_params(config: ModelConfig, key: jax.Array, dtype=jnp.float32) -> dict:
    """Random weights (normal, std 0.02; norms scaling by 1): tests and the `dummy` format.

    Called outside jit, each weight is one program (compiled once per shape), so the peak memory
    is the params plus one weight's f32 draw; under an outer jit the leaves inline into it."""
    shapes = param_shapes(config)
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        shapes, is_leaf=lambda x: isinstance(x, tuple)
    )
    keys = jax.random.split(key, len(flat))
    leaves = []
    for (path, shape), k in zip(flat, keys):
        name = jax.tree_util.keystr(path)
        if "norm" in name:  # Gemma's norms scale by (1 + w): w = 0
            leaves.append(jnp.full(shape, 1.0 - config.norm_offset, dtype))
        else:
            leaves.append(_normal_leaf(k, tuple(shape), jnp.dtype(dtype)))
    return jax.tree_util.tree_unflatten(treedef, leaves)
