"""Ragged paged decode attention in plain XLA: the CPU path whose cost follows the live tokens
(beside the Pallas kernels it is the XLA form of; imports jax only).

The reference (`reference.decode_reference`) gathers a [B, W * ps] block per row, so a decode step
costs B x W pages, W being the step's page-table width: the *longest* live sequence sets the cost
of every row. Here the step's live pages are laid out end to end instead, F of them (a static
bucket >= sum of the rows' pages), and attention is a segmented softmax over that flat list -- the
cost follows the sum of the lengths, as the Pallas kernel's does on the GPU:

    a_b     = window_start(kv_len_b - 1, window) // ps   first page of row b's window (0 if global)
    n_b     = ceil(kv_len_b / ps) - a_b                  pages of row b       i32[B]
    ends    = cumsum(n)                                  row b owns flat pages [ends_b - n_b, ends_b)
    owner_f = searchsorted(ends, f, side="right")        row of flat page f   i32[F]  (B = padding)
    page_f  = page_table[owner_f, a_owner + f - start(owner_f)]
    K, V    = pool[layer][:, page]                       [KVH, F, ps, D]      (only live pages read)
    s       = softcap(q[owner] . K * scale)              [F, KVH, G, ps]      masked to the window
    m_b     = segment_max over the row's pages of max_s  [B, KVH, G]
    out_b   = segment_sum(exp(s - m) V) / segment_sum(exp(s - m))

A sliding-window layer (window > 0; the query sits at kv_len - 1, as in decode) lays out only the
pages from its window's first page on, so it needs F >= sum(ceil(kv_len / ps) - a); the pages
before the window are never gathered. F is static: a step serving global layers too must size it
for them (then the windowed layers leave the rest of the bucket as masked padding).

Equal to the reference up to f32 summation order (tests/pallas_kernels/attention/test_xla.py).
A row with kv_len 0 owns no page and gets zeros, as in the reference. Quantized (int8/fp8) pools multiply the
per-token scales in after the gather. Decode only (one query token per row).

Prefill chunks (T > 1 query tokens per row) take `prefill_attention`: the reference's gather of
each row's W pages and its masks, with the arrays laid out so that a query's result does not
depend on W (the step's page-table width, set by its longest row): XLA's CPU GEMM gives a row of
its result the same bits whatever the other rows, but not a column. So the scores are one dot
with the keys as rows, [B, KVH, S, G*T] = K [S, D] . q [G*T, D], the softmax runs along S, and
the PV dot contracts S from the front of both operands; keys past a row's end add exact zeros.
The division by the softmax sum happens after the PV dot, on [.., D] instead of [.., S]. (Until
JOURNAL.md section 38 the scores were [.., G*T, S], which a prefix-cache hit's narrower step summed
into other bits; about 2x faster per call than this, JOURNAL.md section 38.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.attention.paged_kv import PagedKV, soft_cap, window_start
from pallas_kernels.attention.reference import decode_reference, prefill_reference


def ragged_decode_attention(
    q: jax.Array,
    kv: PagedKV,
    kv_lens: jax.Array,
    page_table: jax.Array,
    num_flat_pages: int,
    *,
    window: jax.Array | int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
) -> jax.Array:
    """q [B, H, D], kv (`PagedKV`: pools [L, KVH, P, ps, D], scales, layer), kv_lens i32[B] (keys
    visible to each row's query, which sits at position kv_len - 1), page_table i32[B, W]
    -> [B, H, D] in q.dtype: `reference.decode_reference` up to f32 summation order.

    window: i32[] | int | None (<= 0 = global): keys kv_len - window .. kv_len - 1 only.
    softcap, scale (static): as in the reference.
    num_flat_pages (static) must be >= sum over rows of the pages from the window's first page to
    the last (all of ceil(kv_lens / ps) when global); pages beyond it would be dropped.
    """
    b, h, d = q.shape
    kvh, ps = kv.k_pages.shape[1], kv.k_pages.shape[3]
    g = h // kvh
    w = page_table.shape[1]
    f = num_flat_pages

    kv_lens = jnp.clip(kv_lens, 0, w * ps)
    first = window_start(kv_lens - 1, window)  # (B,) first visible key
    first_page = first // ps  # (B,)
    n_pages = (kv_lens + ps - 1) // ps - first_page  # (B,) >= 0
    ends = jnp.cumsum(n_pages)
    owner = jnp.searchsorted(ends, jnp.arange(f, dtype=ends.dtype), side="right")  # (F,) in [0, B]
    row = jnp.minimum(owner, b - 1)
    j = first_page[row] + jnp.arange(f) - (ends - n_pages)[row]  # page index within the row
    live = owner < b
    page = jnp.where(live, page_table[row, jnp.clip(j, 0, w - 1)], 0)  # (F,)

    def gather(pages, scale):
        x = pages[kv.layer][:, page].astype(jnp.float32)  # (KVH, F, ps, D)
        if scale is not None:
            x = x * scale[kv.layer][:, page][..., None]
        return x

    k = gather(kv.k_pages, kv.k_scale)
    v = gather(kv.v_pages, kv.v_scale)
    # The barrier keeps XLA from fusing q's producers (the RoPE, with its sin/cos) into this
    # gather, which would recompute them for each of the F flat pages instead of the B rows: on
    # the CPU that fusion cost a fifth of a decode step (JOURNAL.md section 36).
    q = jax.lax.optimization_barrier(q)
    qf = q.astype(jnp.float32).reshape(b, kvh, g, d)[row]  # (F, KVH, G, D)
    s = jnp.einsum("fkgd,kfsd->fkgs", qf, k)  # (F, KVH, G, ps)
    s = s / jnp.sqrt(jnp.float32(d)) if scale is None else s * jnp.float32(scale)
    s = soft_cap(s, softcap)
    tok = j[:, None] * ps + jnp.arange(ps)[None, :]  # (F, ps)
    visible = live[:, None] & (tok < kv_lens[row][:, None])  # (F, ps)
    if window is not None:
        visible &= tok >= first[row][:, None]
    visible = visible[:, None, None, :]  # (F, 1, 1, ps)
    s = jnp.where(visible, s, -jnp.inf)

    seg = dict(segment_ids=owner, num_segments=b + 1, indices_are_sorted=True)  # segment B: padding
    m = jax.ops.segment_max(jnp.max(s, axis=-1), **seg)[:b]  # (B, KVH, G)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(visible, jnp.exp(s - m[row][..., None]), 0.0)  # (F, KVH, G, ps)
    denom = jax.ops.segment_sum(jnp.sum(p, axis=-1), **seg)[:b]  # (B, KVH, G)
    o = jax.ops.segment_sum(jnp.einsum("fkgs,kfsd->fkgd", p, v), **seg)[:b]  # (B, KVH, G, D)
    o = o / jnp.where(denom > 0, denom, 1.0)[..., None]
    return o.reshape(b, h, d).astype(q.dtype)


def prefill_attention(
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
    """`reference.prefill_reference` (same arguments, same result up to f32 summation order) with
    the CPU layout of the module docstring: q [B, T, H, D] -> [B, T, H, D] in q.dtype."""
    b, t, h, d = q.shape
    kvh, ps = kv.k_pages.shape[1], kv.k_pages.shape[3]
    g = h // kvh
    s_len = page_table.shape[1] * ps

    w = page_table.shape[1]

    def gather(pages, scale):
        x = pages[kv.layer][:, page_table].astype(jnp.float32)  # (KVH, B, W, ps, D)
        if scale is not None:
            x = x * scale[kv.layer][:, page_table][..., None]
        return jnp.swapaxes(x, 0, 1)  # (B, KVH, W, ps, D)

    k = gather(kv.k_pages, kv.k_scale)
    v = gather(kv.v_pages, kv.v_scale)
    q = jax.lax.optimization_barrier(q)  # as in the decode path: RoPE is not fused into the copy
    qf = q.astype(jnp.float32).reshape(b, t, kvh, g, d).transpose(0, 2, 3, 1, 4)  # (B,KVH,G,T,D)
    # A query's result must not depend on the page-table width W (the other rows of its step, or
    # a prefix-cache hit's narrower step): XLA's CPU GEMM gives a row of its result the same bits
    # whatever the number of rows, but not a column, and a sum over S keys along the minor axis
    # is not the same sum as over fewer. So the scores are a dot with the keys as rows, and the
    # softmax sum and the PV dot run over S as a leading axis, where keys past a row's end add
    # exact zeros (tests/pallas_kernels/attention/test_xla.py, tests/test_prefix_cache_identity.py).
    # (The transposed form, q . K^T and its softmax along S, ran the call about 2x faster.)
    batch = ((0, 1), (0, 1))
    st = jax.lax.dot_general(k.reshape(b, kvh, s_len, d), qf.reshape(b, kvh, g * t, d),
                             (((3,), (3,)), batch))  # (B, KVH, S, GT)  # fmt: skip
    st = st / jnp.sqrt(jnp.float32(d)) if scale is None else st * jnp.float32(scale)
    st = soft_cap(st, softcap).reshape(b, kvh, w, ps, g, t)
    s_idx = jnp.arange(s_len).reshape(w, ps, 1)
    pos = positions[:, None, None, :]  # (B, 1, 1, T)
    visible = (s_idx[None] <= pos) & (s_idx[None] < seq_lens[:, None, None, None])  # (B,W,ps,T)
    if window is not None:
        visible &= s_idx[None] >= window_start(positions, window)[:, None, None, :]
    visible = visible[:, None, :, :, None]  # (B, 1, W, ps, 1, T)
    st = jnp.where(visible, st, -jnp.inf)
    m = jnp.max(st, axis=(2, 3), keepdims=True)  # (B, KVH, 1, 1, G, T)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    pt = jnp.where(visible, jnp.exp(st - m), 0.0).reshape(b, kvh, s_len, g * t)
    o = jax.lax.dot_general(
        pt, v.reshape(b, kvh, s_len, d), (((2,), (2,)), batch)
    )  # (B, KVH, GT, D)
    denom = jnp.sum(pt, axis=2)  # (B, KVH, GT)
    o = o.reshape(b, kvh, g, t, d) / jnp.where(denom > 0, denom, 1.0).reshape(b, kvh, g, t, 1)
    return o.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d).astype(q.dtype)


reference = {"decode": decode_reference, "prefill": prefill_reference}
"""The pure-jnp definitions the XLA forms are held to: `ragged_decode_attention` to
`decode_reference`, `prefill_attention` to `prefill_reference` (`attention/reference.py`)."""
