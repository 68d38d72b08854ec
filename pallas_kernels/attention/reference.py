"""The pure-jnp definitions of paged attention (gather + einsum) that every backend is held to: the
Triton, Mosaic GPU and XLA forms (tests/pallas_kernels/attention/) and the C++ CPU kernels
(tests/cpu_kernels/); the engine's 'reference' attention runs `prefill_reference`. Jax only, no
Pallas: the CPU kernels take their definitions from here, not from a GPU kernel's file.

    prefill_reference   q [B, T, H, D] at `positions`, causal against each row's pages
    decode_reference    q [B, H, D], one query per row at kv_len - 1 (prefill_reference at T = 1)

Both gather all W pages of every row whatever the window (the kernels and the XLA forms skip the
pages before it) and compute in f32; the logit options are `paged_kv`'s.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.attention.paged_kv import PagedKV, soft_cap, window_start


def prefill_reference(
    q: jax.Array,
    kv: PagedKV,
    positions: jax.Array,
    seq_lens: jax.Array,
    page_table: jax.Array,
    *,
    window: jax.Array | int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
) -> jax.Array:
    """Causal attention of new query tokens against their sequence's pages.

    q:          [B, T, H, D]            T new tokens per row (T=1 for decode), H = KVH * G
    kv:         PagedKV                 the whole pool [L, KVH, P, ps, D] (and scales), its layer
    positions:  i32[B, T]               absolute position of each query token
    seq_lens:   i32[B]                  KV length of each row after this step's writes; 0 = inactive
    page_table: i32[B, W]               the first W pages of each row's sequence
    window:     i32[] | int | None      sliding window (<= 0 or None = global)
    softcap:    float | None            logit soft-cap (static)
    scale:      float | None            logit scale (static); None = 1 / sqrt(D)
    returns     [B, T, H, D] in q.dtype; a query with no visible key (inactive row) gives zeros.

    Query (b, t) sees key positions s with s <= positions[b, t], s < seq_lens[b] and, under a
    window w > 0, positions[b, t] - s < w.
    """
    b, t, h, d = q.shape
    kvh, ps = kv.k_pages.shape[1], kv.k_pages.shape[3]
    g = h // kvh
    w = page_table.shape[1]
    s_len = w * ps

    def gather(pages, scale):
        x = pages[kv.layer][:, page_table]  # (KVH, B, W, ps, D)
        x = x.astype(jnp.float32)
        if scale is not None:
            x = x * scale[kv.layer][:, page_table][..., None]
        return x.reshape(kvh, b, s_len, d)  # (KVH, B, S, D)

    k = gather(kv.k_pages, kv.k_scale)
    v = gather(kv.v_pages, kv.v_scale)
    qf = q.astype(jnp.float32).reshape(b, t, kvh, g, d)  # (B, T, KVH, G, D)
    logits = jnp.einsum("btkgd,kbsd->bkgts", qf, k)
    if scale is None:
        logits = logits / jnp.sqrt(jnp.float32(d))
    else:
        logits = logits * jnp.float32(scale)
    logits = soft_cap(logits, softcap)
    s_idx = jnp.arange(s_len)
    visible = (s_idx[None, None, :] <= positions[:, :, None]) & (
        s_idx[None, None, :] < seq_lens[:, None, None]
    )  # (B, T, S)
    if window is not None:
        visible &= s_idx[None, None, :] >= window_start(positions, window)[:, :, None]
    visible = visible[:, None, None]  # (B, 1, 1, T, S)
    logits = jnp.where(visible, logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(visible, jnp.exp(logits - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bkgts,kbsd->btkgd", p, v)  # (B, T, KVH, G, D)
    return out.reshape(b, t, h, d).astype(q.dtype)


def decode_reference(
    q: jax.Array,
    kv: PagedKV,
    kv_lens: jax.Array,
    page_table: jax.Array,
    *,
    window: jax.Array | int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
) -> jax.Array:
    """One query per row: q [B, H, D] at position kv_len - 1, kv_lens i32[B] clipped to the page
    table's W * ps keys -> [B, H, D] in q.dtype (`prefill_reference` at T = 1).

    Row b's query sees keys s with s < kv_len_b and, under a window w > 0, s >= kv_len_b - w; a
    row with no visible key (kv_len 0) gives zeros.
    """
    lens = jnp.clip(kv_lens, 0, page_table.shape[1] * kv.k_pages.shape[3])
    pos = jnp.maximum(lens - 1, 0)[:, None]  # (B, 1)
    out = prefill_reference(
        q[:, None], kv, pos, lens, page_table, window=window, softcap=softcap, scale=scale
    )
    return out[:, 0]
