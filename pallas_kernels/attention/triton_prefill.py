"""Ragged chunked-prefill attention: a chunk of new tokens per row, causal against the row's pages.

Dataflow of `paged_prefill_attention` (B rows, T tokens per row, H = KVH * G query heads):

    q [B, T, H, D] -> [B, KVH, Tp * Gp, D]      row r of (b, h) = token r // Gp, head g = r % Gp
    positions [B, T] -> [B, Tp * Gp]            (-1 for padding tokens)
    grid (B, KVH, Tp * Gp / BR): program (b, h, i) holds BR query rows (BR / Gp tokens x Gp heads)
        and walks row b's pages up to min(seq_len, max position in the block + 1) in tiles of
        block_k keys gathered from the whole pool [L * KVH * P, ps, D] through the page table:
        online softmax with the causal mask s <= position and s < seq_len
    -> [B, KVH, Tp * Gp, D] -> [B, T, H, D]

A sliding-window layer (window w > 0, a traced i32 read at run time) starts the key loop at the
page holding the block's earliest visible key, max(min position in the block - w + 1, 0), so
pages wholly before every row's window are never loaded: a block's cost is its own tokens plus
the window, not the sequence. Inside the walked range each row masks keys s <= position - w.
Logits are `softcap(q.k * scale)` before the mask (`paged_kv`).

The chunk may start mid-sequence (chunked prefill) and its own K/V are already in the pages (the
model writes them before attention), so "cached pages plus the chunk itself" is one causal mask over
the row's pages. Rows of different lengths and starting points share one launch (ragged). Tokens
with no visible key (padding) give finite garbage; rows with seq_len 0 run no iterations and give
zeros. Int8/fp8 pages are dequantized in the loop as in the decode kernel (K scale on the logits,
V scale on the probabilities).

A decode row (T = 1) also works here, but with one token the block wastes Gp x (BR / Gp - 1) rows
and never splits the keys, so the engine uses `triton_decode.paged_attention` for T == 1.

Lowered through Triton. A Mosaic GPU variant would stream pages with TMA into an SMEM ring
(`plgpu.emit_pipeline`), run Q.K^T and P.V on wgmma with 64-row warpgroup tiles and keep P in
registers (FlashAttention-3 style, as in jax's `attention_mgpu.py`), and skip tiles entirely above
the causal diagonal per warpgroup instead of per program.

The kernel is held to `reference.prefill_reference`, the pure-jnp definition (gather + einsum).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.attention.paged_kv import (
    MASK_VALUE,
    PagedKV,
    check_prefill_inputs,
    soft_cap,
    traced,
)
from pallas_kernels.attention.reference import prefill_reference
from pallas_kernels.attention.triton_common import lowering_pools, next_pow2, paged_pallas_call
from pallas_kernels.attention.tuning import H200_PREFILL, PrefillConfig
from pallas_kernels.lowering import KernelCheck


def _prefill_kernel(
    scalars_ref,  # i32[2]               (layer index into the stacked pool, window; <= 0 global)
    lens_ref,  # i32[B]                  KV length of each row (0 = inactive)
    pt_ref,  # i32[B, Wp + ppb]          page table, padded to whole key tiles plus one tile
    pos_ref,  # i32[BR]                  position of each query row (block of [B, Tp * Gp])
    q_ref,  # [BR, D]                    query rows (block of [B, KVH, Tp * Gp, D])
    k_ref,  # [L * KVH * P, ps, D]       whole K pool, one page per leading index
    v_ref,  # [L * KVH * P, ps, D]       whole V pool
    *refs,  # (ks_ref, vs_ref f32[L * KVH * P, ps] if quantized), o_ref [BR, D] (block of q's shape)
    page_size: int,
    pages_per_block: int,
    max_iters: int,
    num_kv_heads: int,
    num_pages: int,
    quantized: bool,
    sm_scale: float,
    softcap: float | None,
):
    if quantized:
        ks_ref, vs_ref, o_ref = refs
    else:
        (o_ref,) = refs
    b, h = pl.program_id(0), pl.program_id(1)
    block_k = pages_per_block * page_size
    br, d = q_ref.shape
    kv_len = lens_ref[b]
    pos = pos_ref[...]  # (BR,)
    kv_end = jnp.minimum(kv_len, jnp.max(pos) + 1)  # keys past this are invisible to every row
    window = scalars_ref[1]
    windowed = window > 0
    row_start = jnp.where(windowed, pos - window + 1, 0)  # (BR,) first key each row sees
    # Keys before the earliest row's window start are invisible to every row (padding rows, -1,
    # do not count).
    block_start = jnp.min(jnp.where(pos >= 0, row_start, jnp.iinfo(jnp.int32).max))
    end_page = pl.cdiv(jnp.maximum(kv_end, 0), page_size)
    first_page = jnp.where(windowed, jnp.maximum(block_start, 0) // page_size, 0)
    first_page = jnp.minimum(first_page, end_page)  # 0 when global
    n_iter = jnp.minimum(pl.cdiv(end_page - first_page, pages_per_block), max_iters)
    base = (scalars_ref[0] * num_kv_heads + h) * num_pages
    q = q_ref[...]
    cdt = q.dtype

    def body(i, carry):
        o, m, l = carry
        page0 = first_page + i * pages_per_block
        pages = pt_ref[b, pl.ds(page0, pages_per_block)]  # (ppb,)
        pages = base + jnp.clip(pages, 0, num_pages - 1)
        k = k_ref[pages].reshape(block_k, d).astype(cdt)  # (BK, D)
        logits = lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )  # (BR, BK)
        if quantized:
            logits = logits * (ks_ref[pages].reshape(1, block_k) * sm_scale)
        else:
            logits = logits * sm_scale
        logits = soft_cap(logits, softcap)
        tok = page0 * page_size + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        visible = (tok <= pos[:, None]) & (tok < kv_len) & (tok >= row_start[:, None])  # (BR, BK)
        logits = jnp.where(visible, logits, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(logits, axis=1))  # (BR,)
        corr = jnp.exp(m - m_new)
        p = jnp.exp(logits - m_new[:, None])  # (BR, BK)
        l_new = corr * l + jnp.sum(p, axis=1)
        if quantized:
            p = p * vs_ref[pages].reshape(1, block_k)
        v = v_ref[pages].reshape(block_k, d).astype(cdt)  # (BK, D)
        pv = lax.dot_general(
            p.astype(cdt), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )  # (BR, D)
        return corr[:, None] * o + pv, m_new, l_new

    init = (
        jnp.zeros((br, d), jnp.float32),
        jnp.full((br,), jnp.finfo(jnp.float32).min, jnp.float32),
        jnp.zeros((br,), jnp.float32),
    )
    o, _, l = lax.fori_loop(0, n_iter, body, init)
    o_ref[...] = (o / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)


def prefill_plan(tokens: int, group: int, page_size: int, cfg: PrefillConfig):
    """Static tiling: (Gp, tokens per block, pages_per_block)."""
    gp = next_pow2(group)
    most = max(cfg.block_rows // gp, 1)
    least = max(cfg.min_rows // gp, 1)
    block_t = min(most, max(next_pow2(tokens), least))
    pages_per_block = max(cfg.block_k, page_size) // page_size
    return gp, block_t, pages_per_block


@functools.partial(jax.jit, static_argnames=("softcap", "scale", "config", "interpret"))
def _prefill_call(
    q, kv, positions, seq_lens, page_table, window, softcap, scale, config, interpret
):
    """Jitted pallas_call wrapper: q [B, T, H, D] -> [B, T, H, D]."""
    b, t, h, d = q.shape
    kvh, ps = kv.k_pages.shape[1], kv.k_pages.shape[3]
    g = h // kvh
    gp, block_t, ppb = prefill_plan(t, g, ps, config)
    tp = -(-t // block_t) * block_t
    br = block_t * gp
    w = page_table.shape[1]
    wp = -(-w // ppb) * ppb
    # A window's tiles start at its first page, not at a tile boundary: one more tile of columns.
    pt = jnp.pad(page_table, ((0, 0), (0, wp + ppb - w)))  # (B, Wp + ppb)
    qg = q.reshape(b, t, kvh, g, d)
    qg = jnp.pad(qg, ((0, 0), (0, tp - t), (0, 0), (0, gp - g), (0, 0)))  # (B, Tp, KVH, Gp, D)
    qg = qg.transpose(0, 2, 1, 3, 4).reshape(b, kvh, tp * gp, d)  # (B, KVH, Tp * Gp, D)
    pos = jnp.pad(positions, ((0, 0), (0, tp - t)), constant_values=-1)  # (B, Tp)
    pos = jnp.repeat(pos, gp, axis=1)  # (B, Tp * Gp)
    o = paged_pallas_call(
        _prefill_kernel,
        [
            (pos, pl.BlockSpec((None, br), lambda i, j, r: (i, r))),
            (qg, pl.BlockSpec((None, None, br, d), lambda i, j, r: (i, j, r, 0))),
        ],
        kv,
        seq_lens,
        pt,
        window,
        softcap=softcap,
        scale=scale,
        config=config,
        interpret=interpret,
        grid=(b, kvh, tp * gp // br),
        out_specs=pl.BlockSpec((None, None, br, d), lambda i, j, r: (i, j, r, 0)),
        out_shape=jax.ShapeDtypeStruct((b, kvh, tp * gp, d), q.dtype),
        name=f"paged_prefill_ps{ps}_bt{block_t}_gp{gp}",
        pages_per_block=ppb,
        max_iters=wp // ppb,
    )
    o = o.reshape(b, kvh, tp, gp, d)[:, :, :t, :g]  # (B, KVH, T, G, D)
    return o.transpose(0, 2, 1, 3, 4).reshape(b, t, h, d)


# Not jitted itself: the checks run first, outside jit, so a concrete page table and lengths can
# be checked by value; the work is the jitted `_prefill_call` (static: softcap, scale, config,
# interpret).
def paged_prefill_attention(
    q: jax.Array,
    kv: PagedKV,
    positions: jax.Array,
    seq_lens: jax.Array,
    page_table: jax.Array,
    *,
    window: jax.Array | int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    config: PrefillConfig = H200_PREFILL,
    interpret: bool = False,
) -> jax.Array:
    """Causal attention of a ragged chunk of new tokens per row against the row's pages.

    q:          [B, T, H, D]           f32 or bf16; H = KVH * G
    kv:         PagedKV                the whole pool [L, KVH, P, ps, D], the chunk's own K/V
                                       already written; its scales and layer as in
                                       `triton_decode.paged_attention`
    positions:  i32[B, T]              absolute position of each token (a row's chunk may start
                                       mid-sequence; padding tokens may hold anything)
    seq_lens:   i32[B]                 KV length of each row after the chunk's writes; 0 = inactive
    page_table: i32[B, W]              pages of each row
    window:     i32[] | int | None     sliding window (traced; <= 0 or None = global)
    softcap:    float | None           logit soft-cap, s -> softcap * tanh(s / softcap) (static)
    scale:      float | None           logit scale (static); None = 1 / sqrt(D)
    returns     [B, T, H, D] in q.dtype. Token (b, t) sees keys s <= positions[b, t], s < seq_lens[b]
                and, under a window w > 0, s > positions[b, t] - w.
    """
    check_prefill_inputs(q, kv, positions, seq_lens, page_table, window, softcap, scale)
    kv, window = traced(kv, window)
    return _prefill_call(
        q,
        kv,
        positions,
        seq_lens,
        page_table,
        window,
        softcap=softcap,
        scale=scale,
        config=config,
        interpret=interpret,
    )


def lowering_cases() -> list:
    """Every prefill configuration the engine uses: `triton_common.lowering_pools` x chunk."""
    sds = jax.ShapeDtypeStruct
    # (rows, chunk tokens, page-table width): the engine's default step (8 chunks of 64 tokens),
    # a 256-token chunk of one or two sequences, and many rows with a few tokens each.
    shapes = ((8, 64, 64), (2, 256, 64), (16, 16, 64))
    cases = []
    for c in lowering_pools(pages=4096):
        for batch, chunk, width in shapes if c.window is None else shapes[:2]:
            args = (
                sds((batch, chunk, c.heads, c.head_dim), c.q_dtype),
                c.pool,
                sds((batch, chunk), jnp.int32),
                sds((batch,), jnp.int32),
                sds((batch, width), jnp.int32),
            )
            if c.window is None:
                fn = paged_prefill_attention
            else:
                fn = functools.partial(_windowed_prefill, **c.window)
                args += (sds((), jnp.int32),)  # the window a traced i32[] argument
            name = f"prefill/{c.label}/B{batch}xT{chunk}{c.window_label}"
            cases.append(KernelCheck(name, fn, args))
    return cases


def _windowed_prefill(q, kv, pos, lens, pt, window, *, softcap, scale):
    return paged_prefill_attention(
        q, kv, pos, lens, pt, window=window, softcap=softcap, scale=scale
    )


reference = prefill_reference
"""The pure-jnp definition the paged prefill kernel is held to (`attention/reference.py`, the one
definition the family shares; tests/pallas_kernels/attention/ compare against it)."""
