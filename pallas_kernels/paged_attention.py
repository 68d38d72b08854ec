"""Paged attention over the KV page pool (see `jaxserve/kv_cache.py` for the layout).

This file ends with the pure-jnp reference that the model uses on CPU and that the kernels are
tested against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def paged_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    positions: jax.Array,
    seq_lens: jax.Array,
    page_table: jax.Array,
    layer: jax.Array | int = 0,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> jax.Array:
    """Causal attention of new query tokens against their sequence's pages (gather + einsum).

    q:          [B, T, H, D]            T new tokens per row (T=1 for decode), H = KVH * G
    k_pages:    [L, KVH, P, ps, D]      the whole pool; `layer` picks the layer
    v_pages:    [L, KVH, P, ps, D]
    positions:  i32[B, T]               absolute position of each query token
    seq_lens:   i32[B]                  KV length of each row after this step's writes; 0 = inactive
    page_table: i32[B, W]               the first W pages of each row's sequence
    k_scale,
    v_scale:    f32[L, KVH, P, ps] | None   per-token scales of an int8/fp8 cache
    returns     [B, T, H, D] in q.dtype; a query with no visible key (inactive row) gives zeros.

    Query (b, t) sees key positions s with s <= positions[b, t] and s < seq_lens[b].
    """
    b, t, h, d = q.shape
    kvh, ps = k_pages.shape[1], k_pages.shape[3]
    g = h // kvh
    w = page_table.shape[1]
    s_len = w * ps

    def gather(pages, scale):
        x = pages[layer][:, page_table]  # (KVH, B, W, ps, D)
        x = x.astype(jnp.float32)
        if scale is not None:
            x = x * scale[layer][:, page_table][..., None]
        return x.reshape(kvh, b, s_len, d)  # (KVH, B, S, D)

    k = gather(k_pages, k_scale)
    v = gather(v_pages, v_scale)
    qf = q.astype(jnp.float32).reshape(b, t, kvh, g, d)  # (B, T, KVH, G, D)
    logits = jnp.einsum("btkgd,kbsd->bkgts", qf, k) / jnp.sqrt(jnp.float32(d))
    s_idx = jnp.arange(s_len)
    visible = (s_idx[None, None, :] <= positions[:, :, None]) & (
        s_idx[None, None, :] < seq_lens[:, None, None]
    )  # (B, T, S)
    visible = visible[:, None, None]  # (B, 1, 1, T, S)
    logits = jnp.where(visible, logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(visible, jnp.exp(logits - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bkgts,kbsd->btkgd", p, v)  # (B, T, KVH, G, D)
    return out.reshape(b, t, h, d).astype(q.dtype)
