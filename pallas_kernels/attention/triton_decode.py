"""Paged decode attention: one new query token per row against that row's KV pages (flash-decoding).

Dataflow of `paged_attention` (B rows, H = KVH * G query heads, pool of P pages of ps tokens):

    q [B, H, D] -> [B, KVH, Gp, D]          the G heads of one KV head, padded to Gp >= 16 rows
    grid (B, KVH, S): program (b, h, s) walks its share of row b's key blocks (block_k keys each):
        gathers K/V tiles [block_k, D] of layer `layer`, KV head h straight from the whole pool
        [L * KVH * P, ps, D] through the page table (each page read once per KV head), and keeps
        an online softmax: partial out f32[Gp, D], running max m and sum l f32[Gp]
    combine over S (log-sum-exp) -> [B, KVH, Gp, D] -> [B, H, D]

Which key tiles (ppb pages each) program (b, h, s) walks: the row's window starts at key
a = max(kv_len - w, 0) under a window w > 0 (a = 0 when global), on page A = a // ps; the row's
pages [A, ceil(kv_len / ps)) form N tiles, tile n covering pages A + n * ppb ...; split s walks
tiles [s * bps, min((s + 1) * bps, N)) with
    global layer (window <= 0):  bps = pages_per_split / ppb, the static split of the page table
                                 (exactly the tiles and order of the kernel without a window)
    sliding window w > 0:        bps = ceil(N / S): the window's tiles shared evenly by the splits
The window is read at run time (a traced i32, one program for sliding and global layers): a
windowed layer never loads a page wholly before its window, and its splits share the window's
tiles instead of idling, so its cost follows the window, not the sequence. Keys before a on page
A are masked. Logits are `softcap(q.k * scale)` before the mask (`paged_kv`).

The kernel takes the whole stacked pool plus a traced `layer` index (a `PagedKV`), so the model can
call it inside `lax.scan` without slicing (and copying) a layer out of the cache. Rows with seq_len
0 run no iterations and come out as zeros. Int8/fp8 pages are loaded as stored; K's per-token
scale multiplies the logits and V's the probabilities inside the loop, so no dequantized page is
ever written.

Lowered through Triton (`pallas_call` with `triton.CompilerParams`; jax 0.11 deprecates this backend
in favour of Mosaic GPU and warns on each call). A Mosaic GPU variant would
replace the gathered `ref[pages]` loads with TMA copies of whole pages into a multi-buffered SMEM
ring driven by `plgpu.emit_pipeline` (the page table read as scalars per step), run the 16-row
Q.K^T / P.V products on wgmma from SMEM with a warpgroup per KV head, and could drop the padding of
the head group to 16 rows by packing several KV heads' groups into one 64-row wgmma tile.

The kernel is held to `reference.decode_reference`, the pure-jnp definition (gather + einsum).
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
    check_decode_inputs,
    soft_cap,
    traced,
)
from pallas_kernels.attention.reference import decode_reference
from pallas_kernels.attention.triton_common import lowering_pools, next_pow2, paged_pallas_call
from pallas_kernels.attention.tuning import H200_DECODE, DecodeConfig
from pallas_kernels.lowering import KernelCheck

# ------------------------------------------------------------------------------------------------
# Kernel.


def _decode_kernel(
    scalars_ref,  # i32[2]                (layer index into the stacked pool, window; <= 0 global)
    lens_ref,  # i32[B]                   visible KV length of each row
    pt_ref,  # i32[B, Wp]                 page table, padded to S * pages_per_split + ppb
    q_ref,  # [Gp, D]                     this (row, KV head)'s query heads (block of [B, KVH, Gp, D])
    k_ref,  # [L * KVH * P, ps, D]        whole K pool, one page per leading index
    v_ref,  # [L * KVH * P, ps, D]        whole V pool
    *refs,  # (ks_ref, vs_ref f32[L * KVH * P, ps] if quantized), o_ref f32[Gp, D], m_ref, l_ref f32[Gp]
    page_size: int,
    pages_per_block: int,
    pages_per_split: int,
    num_splits: int,
    num_kv_heads: int,
    num_pages: int,
    quantized: bool,
    sm_scale: float,
    softcap: float | None,
):
    if quantized:
        ks_ref, vs_ref, o_ref, m_ref, l_ref = refs
    else:
        o_ref, m_ref, l_ref = refs
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    block_k = pages_per_block * page_size
    gp, d = q_ref.shape
    kv_len = lens_ref[b]
    window = scalars_ref[1]
    windowed = window > 0
    base = (
        scalars_ref[0] * num_kv_heads + h
    ) * num_pages  # first page of (layer, head) in the pool
    win_start = jnp.where(windowed, jnp.maximum(kv_len - window, 0), 0)  # first visible key
    first_page = win_start // page_size  # the window's first page; 0 when global
    n_blocks = pl.cdiv(pl.cdiv(kv_len, page_size) - first_page, pages_per_block)  # key tiles
    bps = jnp.where(  # tiles per split
        windowed, pl.cdiv(n_blocks, num_splits), pages_per_split // pages_per_block
    )
    block0 = s * bps
    n_iter = jnp.maximum(jnp.minimum(bps, n_blocks - block0), 0)
    q = q_ref[...]
    cdt = q.dtype  # products run in the query dtype; int8/fp8 values are exact in bf16/f32

    def body(i, carry):
        o, m, l = carry
        page0 = first_page + (block0 + i) * pages_per_block
        pages = pt_ref[b, pl.ds(page0, pages_per_block)]  # (ppb,)
        pages = base + jnp.clip(pages, 0, num_pages - 1)
        k = k_ref[pages].reshape(block_k, d).astype(cdt)  # (BK, D)
        logits = lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )  # (Gp, BK)
        if quantized:
            logits = logits * (ks_ref[pages].reshape(1, block_k) * sm_scale)
        else:
            logits = logits * sm_scale
        logits = soft_cap(logits, softcap)
        tok = page0 * page_size + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        logits = jnp.where((tok < kv_len) & (tok >= win_start), logits, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(logits, axis=1))  # (Gp,)
        corr = jnp.exp(m - m_new)
        p = jnp.exp(logits - m_new[:, None])  # (Gp, BK)
        l_new = corr * l + jnp.sum(p, axis=1)
        if quantized:
            p = p * vs_ref[pages].reshape(1, block_k)
        v = v_ref[pages].reshape(block_k, d).astype(cdt)  # (BK, D)
        pv = lax.dot_general(
            p.astype(cdt), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )  # (Gp, D)
        return corr[:, None] * o + pv, m_new, l_new

    init = (
        jnp.zeros((gp, d), jnp.float32),
        jnp.full((gp,), jnp.finfo(jnp.float32).min, jnp.float32),
        jnp.zeros((gp,), jnp.float32),
    )
    o, m, l = lax.fori_loop(0, n_iter, body, init)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


def decode_plan(batch: int, num_kv_heads: int, width: int, page_size: int, cfg: DecodeConfig):
    """Static split-K plan: (pages_per_block, splits, pages_per_split)."""
    pages_per_block = max(cfg.block_k, page_size) // page_size
    n_blocks = -(-width // pages_per_block)
    splits = 1
    while (
        splits * 2 <= min(cfg.max_splits, n_blocks)
        and batch * num_kv_heads * splits < cfg.target_programs
    ):
        splits *= 2
    pages_per_split = -(-n_blocks // splits) * pages_per_block
    return pages_per_block, splits, pages_per_split


@functools.partial(jax.jit, static_argnames=("softcap", "scale", "config", "interpret"))
def _decode_call(q, kv, seq_lens, page_table, window, softcap, scale, config, interpret):
    """Jitted pallas_call wrapper: q [B, H, D] -> [B, H, D]."""
    b, h, d = q.shape
    kvh, ps = kv.k_pages.shape[1], kv.k_pages.shape[3]
    g = h // kvh
    gp = max(config.min_group_rows, next_pow2(g))
    ppb, splits, pps = decode_plan(b, kvh, page_table.shape[1], ps, config)
    # A window's tiles start at its first page, not at a tile boundary: one more tile of columns.
    wp = splits * pps + ppb
    pt = jnp.pad(page_table, ((0, 0), (0, wp - page_table.shape[1])))  # (B, Wp)
    qg = jnp.pad(q.reshape(b, kvh, g, d), ((0, 0), (0, 0), (0, gp - g), (0, 0)))  # (B, KVH, Gp, D)
    o, m, l = paged_pallas_call(
        _decode_kernel,
        [(qg, pl.BlockSpec((None, None, gp, d), lambda i, j, s: (i, j, 0, 0)))],
        kv,
        seq_lens,
        pt,
        window,
        softcap=softcap,
        scale=scale,
        config=config,
        interpret=interpret,
        grid=(b, kvh, splits),
        out_specs=[
            pl.BlockSpec((None, None, None, gp, d), lambda i, j, s: (i, j, s, 0, 0)),
            pl.BlockSpec((None, None, None, gp), lambda i, j, s: (i, j, s, 0)),
            pl.BlockSpec((None, None, None, gp), lambda i, j, s: (i, j, s, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, kvh, splits, gp, d), jnp.float32),
            jax.ShapeDtypeStruct((b, kvh, splits, gp), jnp.float32),
            jax.ShapeDtypeStruct((b, kvh, splits, gp), jnp.float32),
        ],
        name=f"paged_decode_ps{ps}_ppb{ppb}_s{splits}",
        pages_per_block=ppb,
        pages_per_split=pps,
        num_splits=splits,
    )
    # Log-sum-exp combine of the S partial results. Empty splits have l = 0 and m = f32.min.
    m_all = jnp.max(m, axis=2, keepdims=True)  # (B, KVH, 1, Gp)
    corr = jnp.exp(m - m_all)  # (B, KVH, S, Gp)
    l_all = jnp.sum(l * corr, axis=2)  # (B, KVH, Gp)
    o = jnp.sum(o * corr[..., None], axis=2)  # (B, KVH, Gp, D)
    o = o / jnp.where(l_all > 0, l_all, 1.0)[..., None]  # inactive rows: 0 / 1 = 0
    return o[:, :, :g].reshape(b, h, d).astype(q.dtype)


# Not jitted itself: the checks run first, outside jit, so a concrete page table and lengths can
# be checked by value; the work is the jitted `_decode_call` (static: softcap, scale, config,
# interpret).
def paged_attention(
    q: jax.Array,
    kv: PagedKV,
    seq_lens: jax.Array,
    page_table: jax.Array,
    *,
    window: jax.Array | int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    config: DecodeConfig = H200_DECODE,
    interpret: bool = False,
) -> jax.Array:
    """Decode attention of one new token per row against its pages.

    q:          [B, H, D]              f32 or bf16; H = KVH * G
    kv:         PagedKV                the whole pool [L, KVH, P, ps, D] (model dtype, int8 or fp8,
                                       ps and D powers of two), the scales exactly for int8/fp8
                                       pages, and the layer to read (traced inside lax.scan)
    seq_lens:   i32[B]                 visible KV length per row (keys 0..seq_len-1); 0 = inactive
    page_table: i32[B, W]              pages of each row; entries past a row's length are ignored
    window:     i32[] | int | None     sliding window: keys seq_len - window .. seq_len - 1 only (the
                                       query sits at seq_len - 1); <= 0 or None = global. Traced.
    softcap:    float | None           logit soft-cap, s -> softcap * tanh(s / softcap) (static)
    scale:      float | None           logit scale (static); None = 1 / sqrt(D)
    returns     [B, H, D] in q.dtype; zeros for rows with seq_len 0.
    """
    check_decode_inputs(q, kv, seq_lens, page_table, window, softcap, scale)
    kv, window = traced(kv, window)
    return _decode_call(
        q,
        kv,
        seq_lens,
        page_table,
        window,
        softcap=softcap,
        scale=scale,
        config=config,
        interpret=interpret,
    )


# ------------------------------------------------------------------------------------------------
# CUDA lowering cases for `python -m pallas_kernels.check`.


def lowering_cases() -> list:
    """Every decode configuration the engine uses (`triton_common.lowering_pools`)."""
    sds = jax.ShapeDtypeStruct
    batch, width = 64, 64  # 64 slots, contexts up to 64 pages, a 4096-page pool
    cases = []
    for c in lowering_pools(pages=4096):
        q = sds((batch, c.heads, c.head_dim), c.q_dtype)
        args = (q, c.pool, sds((batch,), jnp.int32), sds((batch, width), jnp.int32))
        if c.window is None:
            fn = paged_attention
        else:
            fn = functools.partial(_windowed_decode, **c.window)
            args += (sds((), jnp.int32),)  # the window a traced i32[] argument
        cases.append(KernelCheck(f"decode/{c.label}{c.window_label}", fn, args))
    return cases


def _windowed_decode(q, kv, lens, pt, window, *, softcap, scale):
    return paged_attention(q, kv, lens, pt, window=window, softcap=softcap, scale=scale)


reference = decode_reference
"""The pure-jnp definition the paged decode kernel is held to (`attention/reference.py`, the one
definition the family shares; tests/pallas_kernels/attention/ compare against it)."""
