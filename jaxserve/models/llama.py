"""A functional Llama-family transformer (Llama 2/3/3.1, Mistral, Qwen2, SmolLM2) over a paged KV cache.

    forward(params, tokens, meta, cache, config, impl) -> (hidden, cache)
    decoder_layer(lp, x, positions, attend, config, proj) -> (x, aux, taps)   one layer
    compute_logits(params, hidden, config, impl) -> f32 logits

`decoder_layer` is written once: `forward` scans it over the paged cache, calibration
(`quant/calibration.py`) runs it with a dense causal attention to collect the linears' inputs.

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

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.layers import kv_cache as kvc
from jaxserve.layers.attention import AttentionMetadata, attention
from jaxserve.layers.embedding import embed, is_quantized
from jaxserve.layers.linear import linear, matmul
from jaxserve.layers.norm import rms_norm
from jaxserve.layers.rope import apply_rope
from jaxserve.resolve import REFERENCE_IMPL, ModelImpl


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
    impl: ModelImpl = REFERENCE_IMPL,
) -> tuple[jax.Array, kvc.KVCache]:
    """Runs the new tokens through every layer, writing their K/V into the paged cache.

    tokens: i32[B, T]; meta: positions/slot_mapping [B, T], page_table [B, W], seq_lens [B].
    impl (static): the attention implementation and the matmul row padding (`jaxserve.resolve`).
    Returns the final-norm hidden states [B, T, D] (params dtype) and the updated cache.
    """
    c = config
    dtype = model_dtype(params)
    x = embed(params["embed"], tokens, dtype)  # (B, T, D)
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
            w = whole[name] if name in whole else lp[name]
            return linear(a, w, layer=li if name in whole else None, min_rows=impl.min_matmul_rows)

        x, cache, _ = decoder_layer(
            lp, x, meta.positions, paged_attend(cache, li, meta, impl), c, proj
        )
        return (x, cache), None

    (x, cache), _ = jax.lax.scan(
        layer, (x, cache), (scanned, jnp.arange(c.num_layers, dtype=jnp.int32))
    )
    return rms_norm(x, params["final_norm"], c.rms_norm_eps), cache


def paged_attend(cache: kvc.KVCache, layer, meta: AttentionMetadata, impl: ModelImpl):
    """The engine's `attend` for `decoder_layer`: writes the new tokens' K/V into layer `layer`
    of the paged cache (ONE write, before attention reads it, so XLA updates the donated pool in
    place), then runs paged attention over it. Returns (out [B, T, H, Dh], the updated cache)."""

    def attend(q, k, v):
        new = kvc.write(cache, layer, k, v, meta.slot_mapping)
        return attention(q, new, layer, meta, impl.attention), new

    return attend


def decoder_layer(
    lp: dict,
    x: jax.Array,
    positions: jax.Array,
    attend: Callable,
    config: ModelConfig,
    proj: Callable | None = None,
) -> tuple[jax.Array, Any, dict]:
    """One decoder layer: the engine's, calibration's (AWQ/GPTQ statistics) and the experiments'.

    lp: the layer's params (no layer axis) or, with `proj`, at least its norms and biases;
    x [B, T, D] in the activation dtype; positions i32[B, T];
    attend(q [B, T, H, Dh] (roped), k [B, T, KVH, Dh] (roped), v [B, T, KVH, Dh]) ->
      (out [B, T, H, Dh], aux): the attention over whatever holds the keys (the paged cache, whose
      updated self is `aux`; or a dense causal softmax over the window);
    proj(a, name) -> a @ the layer's weight `name` (default: `linear(a, lp[name])`).

    Returns (x' [B, T, D], aux, taps), taps = the inputs of the layer's linears, {"attn" [B, T, D]
    -> wq/wk/wv, "o" [B, T, H*Dh] -> wo, "mlp" [B, T, D] -> w_gate/w_up, "down" [B, T, I] ->
    w_down} and the roped queries "q" [B, T, H, Dh]. Unused taps cost nothing under jit.
    """
    c = config
    b, t, _ = x.shape
    h, kvh, dh = c.num_heads, c.num_kv_heads, c.head_dim
    dtype = x.dtype
    inv_freq = c.inv_freq()
    if proj is None:
        proj = lambda a, name: linear(a, lp[name])  # noqa: E731

    a_in = rms_norm(x, lp["attn_norm"], c.rms_norm_eps)  # (B, T, D)
    q, k, v = proj(a_in, "wq"), proj(a_in, "wk"), proj(a_in, "wv")
    if c.attention_bias:
        q = q + lp["bq"].astype(dtype)
        k = k + lp["bk"].astype(dtype)
        v = v + lp["bv"].astype(dtype)
    q = apply_rope(q.reshape(b, t, h, dh), positions, inv_freq)  # (B, T, H, Dh)
    k = apply_rope(k.reshape(b, t, kvh, dh), positions, inv_freq)  # (B, T, KVH, Dh)
    o, aux = attend(q, k, v.reshape(b, t, kvh, dh))
    o_in = o.reshape(b, t, h * dh)
    x = x + proj(o_in, "wo")
    m_in = rms_norm(x, lp["mlp_norm"], c.rms_norm_eps)
    d_in = jax.nn.silu(proj(m_in, "w_gate").astype(jnp.float32)).astype(dtype) * proj(m_in, "w_up")
    x = x + proj(d_in, "w_down")
    return x, aux, {"attn": a_in, "q": q, "o": o_in, "mlp": m_in, "down": d_in}


def compute_logits(
    params: dict, hidden: jax.Array, config: ModelConfig, impl: ModelImpl = REFERENCE_IMPL
) -> jax.Array:
    """hidden[..., D] -> f32 logits[..., V]."""
    rows = impl.min_matmul_rows
    if config.tie_word_embeddings:
        w = params["embed"]
        if is_quantized(w):  # the lm_head view (D, V)
            return linear(hidden, w).astype(jnp.float32)
        return matmul(
            hidden, w.astype(hidden.dtype), transposed=True, out_dtype=jnp.float32, min_rows=rows
        )
    return linear(hidden, params["lm_head"], min_rows=rows).astype(jnp.float32)
