"""A functional Llama-family transformer (Llama 2/3/3.1, Mistral, Qwen2, SmolLM2) over a paged KV cache.

    forward(params, tokens, meta, cache, config, attn_impl) -> (hidden, cache)
    forward_parts(params, [(tokens, meta), ...], cache, config, attn_impl) -> ([hidden], cache)
    compute_logits(params, hidden, config) -> f32 logits

Params are a plain pytree passed into jit (never closed over). Per-layer weights are stacked on a
leading layer axis and the layers run under `lax.scan`, so compile time does not depend on depth:

    embed        [V, D]           or a quantized weight in the lm_head view [D, V] (see below)
    layers/
      attn_norm  [L, D]
      wq         [L, D, H*Dh]     (+ bq [L, H*Dh] when config.attention_bias, Qwen2)
      wk, wv     [L, D, KVH*Dh]   (+ bk, bv [L, KVH*Dh])
      wo         [L, H*Dh, D]
      mlp_norm   [L, D]
      w_gate     [L, D, I]
      w_up       [L, D, I]
      w_down     [L, I, D]
    final_norm   [D]
    lm_head      [D, V]           absent when config.tie_word_embeddings (logits use embed^T)

Linear weights are `[in, out]` arrays or quantized-weight pytrees (see `jaxserve.quant`) with the
same logical shape; `layers.linear.linear` multiplies either. A quantized embedding is stored as the
output projection it is when tied, logical [D, V] (`layers.embedding`): the lookup gathers its
columns and tied logits are `linear(hidden, embed)`. Norms and softmax run in f32; matmuls in the
params' dtype (`model_dtype`: the float embedding's, else final_norm's).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.layers import kv_cache as kvc
from jaxserve.layers.attention import AttentionMetadata, attention
from jaxserve.layers.embedding import embed, is_quantized
from jaxserve.layers.linear import linear, matmul
from jaxserve.layers.norm import rms_norm
from jaxserve.layers.rope import apply_rope


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
        "w_gate": (L, D, I),
        "w_up": (L, D, I),
        "w_down": (L, I, D),
    }
    if c.attention_bias:
        layers.update({"bq": (L, qd), "bk": (L, kd), "bv": (L, kd)})
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


def init_params(config: ModelConfig, key: jax.Array, dtype=jnp.float32) -> dict:
    """Random weights (normal, std 0.02; norms at 1): tests and the `dummy` load format."""
    shapes = param_shapes(config)
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        shapes, is_leaf=lambda x: isinstance(x, tuple)
    )
    keys = jax.random.split(key, len(flat))
    leaves = []
    for (path, shape), k in zip(flat, keys):
        name = jax.tree_util.keystr(path)
        if "norm" in name:
            leaves.append(jnp.ones(shape, dtype))
        else:
            leaves.append((0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dtype))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def forward(
    params: dict,
    tokens: jax.Array,
    meta: AttentionMetadata,
    cache: kvc.KVCache,
    config: ModelConfig,
    attn_impl: str = "reference",
) -> tuple[jax.Array, kvc.KVCache]:
    """Runs the new tokens through every layer, writing their K/V into the paged cache.

    tokens: i32[B, T]; meta: positions/slot_mapping [B, T], page_table [B, W], seq_lens [B].
    Returns the final-norm hidden states [B, T, D] (params dtype) and the updated cache.
    """
    (hidden,), cache = forward_parts(params, [(tokens, meta)], cache, config, attn_impl)
    return hidden, cache


def forward_parts(
    params: dict,
    parts: list[tuple[jax.Array, AttentionMetadata]],
    cache: kvc.KVCache,
    config: ModelConfig,
    attn_impl: str = "reference",
) -> tuple[list[jax.Array], kvc.KVCache]:
    """`forward` over several token batches at once (e.g. decode rows [B, 1] and a prefill chunk
    [R, T]): parts = [(tokens i32[B_i, T_i], meta_i)], each with its own attention metadata.

    The norms, projections and MLP run on all the parts' tokens together ([N, D], N = sum of
    B_i * T_i), so each layer's weights are read once; rope, the K/V writes and attention run per
    part. Parts must write disjoint cache slots. Returns ([hidden_i [B_i, T_i, D]], cache).
    """
    c = config
    h, kvh, dh = c.num_heads, c.num_kv_heads, c.head_dim
    inv_freq = c.inv_freq()
    dtype = model_dtype(params)
    shapes = [tokens.shape for tokens, _ in parts]
    metas = [meta for _, meta in parts]
    x = jnp.concatenate(
        [embed(params["embed"], tokens, dtype).reshape(-1, c.hidden_size) for tokens, _ in parts]
    )  # (N, D)

    def split(a):  # (N, ...) -> [(B_i, T_i, ...)]
        out, start = [], 0
        for b, t in shapes:
            out.append(a[start : start + b * t].reshape(b, t, *a.shape[1:]))
            start += b * t
        return out

    # Weights whose kernel reads a layer of the stack in place (INT4) stay out of the scan's
    # inputs, which would slice (copy) each layer out for the kernel; they get the layer index.
    whole = {
        name: w for name, w in params["layers"].items() if getattr(w, "reads_layer_in_place", False)
    }
    scanned = {name: w for name, w in params["layers"].items() if name not in whole}

    def layer(carry, xs):
        x, cache = carry
        lp, li = xs

        def proj(a, name):  # a @ layer li's weight `name`
            if name in whole:
                return linear(a, whole[name], layer=li)
            return linear(a, lp[name])

        y = rms_norm(x, lp["attn_norm"], c.rms_norm_eps)
        q = proj(y, "wq")
        k = proj(y, "wk")
        v = proj(y, "wv")
        if c.attention_bias:
            q = q + lp["bq"].astype(dtype)
            k = k + lp["bk"].astype(dtype)
            v = v + lp["bv"].astype(dtype)
        qs, ks = [], []
        for qi, ki, meta in zip(split(q), split(k), metas):
            b, t = qi.shape[:2]
            qs.append(apply_rope(qi.reshape(b, t, h, dh), meta.positions, inv_freq))
            ks.append(
                apply_rope(ki.reshape(b, t, kvh, dh), meta.positions, inv_freq).reshape(-1, kvh, dh)
            )
        # ONE write of every part's K/V before any attention reads: the cache is then updated in
        # place (a write between two reads of it would make XLA copy the whole pool).
        cache = kvc.write(
            cache,
            li,
            jnp.concatenate(ks)[None],
            v.reshape(1, -1, kvh, dh),
            jnp.concatenate([m.slot_mapping.reshape(-1) for m in metas])[None],
        )
        outs = [
            attention(qi, cache, li, meta, attn_impl).reshape(-1, h * dh)
            for qi, meta in zip(qs, metas)
        ]
        o = jnp.concatenate(outs) if len(outs) > 1 else outs[0]  # (N, H*Dh)
        x = x + proj(o, "wo")
        y = rms_norm(x, lp["mlp_norm"], c.rms_norm_eps)
        gate = jax.nn.silu(proj(y, "w_gate").astype(jnp.float32)).astype(dtype)
        x = x + proj(gate * proj(y, "w_up"), "w_down")
        return (x, cache), None

    (x, cache), _ = jax.lax.scan(
        layer, (x, cache), (scanned, jnp.arange(c.num_layers, dtype=jnp.int32))
    )
    return split(rms_norm(x, params["final_norm"], c.rms_norm_eps)), cache


def compute_logits(params: dict, hidden: jax.Array, config: ModelConfig) -> jax.Array:
    """hidden[..., D] -> f32 logits[..., V]."""
    if config.tie_word_embeddings:
        w = params["embed"]
        if is_quantized(w):  # the lm_head view (D, V)
            return linear(hidden, w).astype(jnp.float32)
        return matmul(hidden, w.astype(hidden.dtype), transposed=True, out_dtype=jnp.float32)
    return linear(hidden, params["lm_head"]).astype(jnp.float32)
