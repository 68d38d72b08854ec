"""Ragged chunked-prefill paged attention on Pallas Mosaic GPU (Hopper: TMA + wgmma), the successor
of the Triton `paged_prefill` (jax 0.11 deprecates the Pallas Triton backend).

Same call, same semantics as `triton_prefill.paged_prefill_attention` (a ragged chunk of new tokens
per row, causal against the row's pages, whose own K/V the model has already written; the whole
stacked pool and a traced `layer` in a `PagedKV`, GQA, scale, soft-cap, traced sliding window,
int8/fp8 pages with per-token scales). Dataflow of `paged_prefill_mgpu` (B rows, T tokens, H = KVH * G query
heads, Gp = next_pow2(G), pool of P pages of ps tokens, BK = block_k keys per step):

    q [B, T, H, D] -> [B, KVH, Tp * Gp, D]   row r of (b, h) = token r // Gp, head r % Gp: tiles
                                            of 64 rows (64 / Gp tokens), a wgmma M tile each
    positions -> i32[B, Tp * Gp]            each row's position (-1: padding)
    plan i32[B, NT, 4]                      per row tile, in XLA from the positions, lengths and
                                            window: (first page, i_a, i_b, n), below
    grid (B, KVH, NT), one warpgroup per program (b, h, tile), heaviest tiles (latest positions)
    first. The program walks the n key tiles from the page of the tile's earliest visible key
    (its window's start; 0 when global) to min(seq_len, max position + 1): tiles wholly above the
    causal diagonal or before every row's window are never loaded. With the decode kernel's ring
    (`mgpu_common.KVRing`: page-table scalars, TMA of each page into a multi-buffered SMEM
    ring, int8/fp8 pages dequantized into a bf16 slot) and its online-softmax step (`attend`:
    S = Q . K^T and O += P . V on wgmma from SMEM, softmax in registers):
        tiles [0, i_a)      masked: s <= position, s < seq_len, s > position - window
        tiles [i_a, i_b)    unmasked: every key visible to every (non-padding) row of the tile
        tiles [i_b, n)      masked: the causal diagonal and the row's end
    o / l -> bf16 -> SMEM (the q tile's) -> TMA -> [B, KVH, Tp * Gp, D] -> [B, T, H, D]

Rows with seq_len 0 (and tiles of padding only) run no iterations and give zeros; padding tokens
give finite garbage (unmasked, they average the keys, or see MASK_VALUE logits only). The products
run in bf16 with f32 accumulation, int8/fp8 values times their scale rounded to bf16. Lowering
semantics: Warpgroup (jax's default), one warpgroup per block, no warp specialization (TMA of tile i + NBUF is issued
when tile i's products are done). At the Llama-3-8B prefill shape (sm_90a) ptxas reports 225
registers and no spills with bf16 pages, 255 registers and 36 bytes of spills with fp8/int8 pages
(the test prints it); head_dim 256 spills ~0.9 KB (the f32 accumulator alone is 128 registers).

Refused with a ValueError (`mgpu_common.check_mgpu_options`, the decode kernel's): f32
queries, KV pages other than bf16/int8/fp8, page sizes below 8, head dims other than 64/128/256,
GQA groups over 64 heads, and configs whose SMEM exceeds the 227 KiB of a Hopper block.

`interpret=True` runs the kernel in Mosaic GPU's interpreter on the CPU (SMEM, TMA, barriers and
wgmma simulated). The tiles are an `MgpuPrefillConfig` (`tuning`). The kernel is held to
`reference.prefill_reference`, the pure-jnp definition (gather + einsum).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.attention.mgpu_common import (
    KVRing,
    attend,
    check_mgpu_options,
    kv_ring_scratch,
    softmax_init,
)
from pallas_kernels.attention.paged_kv import (
    PagedKV,
    check_prefill_inputs,
    kernel_scalars,
    pool_operands,
    traced,
)
from pallas_kernels.attention.reference import prefill_reference
from pallas_kernels.attention.triton_common import next_pow2
from pallas_kernels.attention.tuning import H100_MGPU_PREFILL, MgpuPrefillConfig
from pallas_kernels.mgpu_common import ROWS, tiled_smem

_BIG = 1 << 30  # "no row" in the plan's min/max (far from overflow)


def _prefill_kernel(
    scalars_ref,  # i32[2]                   GMEM: (layer, window; <= 0 global)
    lens_ref,  # i32[B]                      GMEM
    pt_ref,  # i32[B, W + ppb]               GMEM page table, one tile of padding columns
    plan_ref,  # i32[B, NT, 4]               GMEM (first page, i_a, i_b, n) of each row tile
    pos_ref,  # i32[B, Tp * Gp]              GMEM position of each query row (-1: padding)
    q_ref,  # bf16[B, KVH, Tp * Gp, D]       GMEM
    k_ref,  # [L * KVH * P, ps, D]           GMEM: the whole K pool, one page per leading index
    v_ref,  # [L * KVH * P, ps, D]           GMEM
    *refs,  # (ks_ref, vs_ref f32[L * KVH * P, ps]), o_ref bf16[B, KVH, Tp * Gp, D]
    page_size: int,
    block_k: int,
    num_buffers: int,
    num_tiles: int,
    num_kv_heads: int,
    num_pages: int,
    sm_scale: float,
    softcap: float | None,
):
    ks_ref, vs_ref, o_ref = refs if len(refs) == 3 else (None, None, *refs)
    b, h = lax.axis_index("b"), lax.axis_index("h")
    tile = num_tiles - 1 - lax.axis_index("r")  # the latest (longest) tiles first
    ps, nbuf = page_size, num_buffers
    ppb = block_k // ps
    d = q_ref.shape[-1]
    cdt = q_ref.dtype  # bf16
    rows = pl.ds(tile * ROWS, ROWS)
    kv_len = lens_ref[b]
    window = scalars_ref[1]
    base = (scalars_ref[0] * num_kv_heads + h) * num_pages  # first page of (layer, head)
    first_page, i_a, i_b, n_iter = (plan_ref[b, tile, j] for j in range(4))

    def tile_pages(i):
        """page_of of key tile i (pages past the row's end are clipped into the pool, masked)."""
        page0 = first_page + i * ppb
        return lambda j: base + jnp.clip(pt_ref[b, page0 + j], 0, num_pages - 1)

    def scope(q_smem, pos_smem, p_smem, k_smem, v_smem, raw, kv_bar, q_bar):
        ring = KVRing(k_ref, v_ref, ks_ref, vs_ref, k_smem, v_smem, raw, kv_bar, ps)
        plgpu.copy_gmem_to_smem(q_ref.at[b, h, rows], q_smem, q_bar)
        plgpu.copy_gmem_to_smem(pos_ref.at[b, rows], pos_smem, q_bar)
        for i in range(nbuf):  # prologue: the ring's first tiles in flight
            pl.when(i < n_iter)(functools.partial(ring.issue, i, tile_pages(jnp.int32(i))))
        plgpu.barrier_wait(q_bar)
        pos = plgpu.load(pos_smem, layout=plgpu.Layout.WGMMA.reduce(1))  # i32[64]
        last = jnp.minimum(pos, kv_len - 1)  # each row's last visible key
        # and its first: pos - window + 1, or -2^30 (none) when global (a scalar select: Mosaic
        # GPU does not broadcast a scalar predicate over a vector)
        first = pos - jnp.where(window > 0, window - 1, _BIG)

        def visible(tok):
            shape = tok.shape
            return (tok <= lax.broadcast_in_dim(last, shape, [0])) & (
                tok >= lax.broadcast_in_dim(first, shape, [0])
            )

        def body(i, carry, masked):
            slot = lax.rem(i, nbuf)
            k, v = ring.wait(slot, tile_pages(i))
            tok0 = (first_page + i * ppb) * ps
            carry = attend(
                carry,
                q_smem,
                k,
                v,
                p_smem,
                tok0,
                sm_scale=sm_scale,
                softcap=softcap,
                visible=visible if masked else None,
            )

            @pl.when(i + nbuf < n_iter)
            def _():  # the slot's products are done: refill it with tile i + nbuf
                ring.issue(slot, tile_pages(i + nbuf))

            return carry

        masked = functools.partial(body, masked=True)
        carry = lax.fori_loop(0, i_a, masked, softmax_init(ROWS, d))
        carry = lax.fori_loop(i_a, i_b, functools.partial(body, masked=False), carry)
        o, _, l = lax.fori_loop(i_b, n_iter, masked, carry)
        inv = 1.0 / jnp.where(l > 0, l, 1.0)  # rows with no key: 0 * 1 = 0
        q_smem[...] = (o * lax.broadcast_in_dim(inv, o.shape, [0])).astype(cdt)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, o_ref.at[b, h, rows])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(
        scope,
        tiled_smem((ROWS, d), cdt),  # q tile, then the output tile
        plgpu.SMEM((ROWS,), jnp.int32),
        tiled_smem((ROWS, block_k), cdt),
        *kv_ring_scratch(nbuf, block_k, d, cdt, k_ref.dtype, ps),
        plgpu.Barrier(num_arrivals=2),
    )


def _tile_plan(pos, seq_lens, window, page_size: int, block_k: int):
    """(first page, i_a, i_b, n) i32[B, NT, 4] of row tiles of token positions pos i32[B, NT, Tt]
    (-1: padding): the n key tiles walked from the first page, and [i_a, i_b) those every real row
    of the tile sees whole (no mask). The Triton kernel's bounds, once per tile in XLA."""
    valid = pos >= 0
    kv_len = seq_lens[:, None]
    windowed = window > 0
    start = jnp.where(windowed, pos - window + 1, 0)  # each token's first visible key
    end = jnp.minimum(jnp.max(pos, axis=-1), kv_len - 1) + 1  # keys past it: invisible to all
    end_page = pl.cdiv(jnp.maximum(end, 0), page_size)
    lo = jnp.min(jnp.where(valid, start, _BIG), axis=-1)
    first_page = jnp.minimum(jnp.where(windowed, jnp.maximum(lo, 0) // page_size, 0), end_page)
    n = pl.cdiv(end_page - first_page, block_k // page_size)
    k0 = first_page * page_size
    full_lo = jnp.max(jnp.where(valid, start, 0), axis=-1)  # keys >= this: past every start
    full_hi = jnp.minimum(jnp.min(jnp.where(valid, pos, _BIG), axis=-1) + 1, kv_len)
    i_a = jnp.clip(-((k0 - full_lo) // block_k), 0, n)  # ceil
    i_b = jnp.clip((full_hi - k0) // block_k, i_a, n)
    return jnp.stack([first_page, i_a, i_b, n], axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("softcap", "scale", "config", "interpret"))
def _prefill_call(
    q, kv, positions, seq_lens, page_table, window, softcap, scale, config, interpret
):
    """Jitted Mosaic GPU kernel wrapper: q [B, T, H, D] -> [B, T, H, D]."""
    b, t, h, d = q.shape
    _, kvh, n_pages, ps, _ = kv.k_pages.shape
    g = h // kvh
    gp = next_pow2(g)
    tt = ROWS // gp  # tokens per row tile
    tp = -(-t // tt) * tt
    nt = tp // tt
    block_k = max(config.block_k, ps)
    # A window's tiles start at its first page, not at a tile boundary: one more tile of columns.
    pt = jnp.pad(page_table, ((0, 0), (0, block_k // ps)))
    qg = jnp.pad(q.reshape(b, t, kvh, g, d), ((0, 0), (0, tp - t), (0, 0), (0, gp - g), (0, 0)))
    qg = qg.transpose(0, 2, 1, 3, 4).reshape(b, kvh, tp * gp, d)  # (B, KVH, Tp * Gp, D)
    pos = jnp.pad(positions, ((0, 0), (0, tp - t)), constant_values=-1)  # (B, Tp)
    plan = _tile_plan(pos.reshape(b, nt, tt), seq_lens, window, ps, block_k)
    pos_rows = jnp.repeat(pos, gp, axis=1)  # (B, Tp * Gp)
    args = [kernel_scalars(kv, window), seq_lens, pt, plan, pos_rows, qg, *pool_operands(kv)]
    kernel = functools.partial(
        _prefill_kernel,
        page_size=ps,
        block_k=block_k,
        num_buffers=config.num_buffers,
        num_tiles=nt,
        num_kv_heads=kvh,
        num_pages=n_pages,
        sm_scale=1.0 / math.sqrt(d) if scale is None else float(scale),
        softcap=None if softcap is None else float(softcap),
    )
    o = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((b, kvh, tp * gp, d), q.dtype),
        grid=(b, kvh, nt),
        grid_names=("b", "h", "r"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name=f"mgpu_paged_prefill_ps{ps}_bk{block_k}_gp{gp}",
    )(*args)
    o = o.reshape(b, kvh, tp, gp, d)[:, :, :t, :g]  # (B, KVH, T, G, D)
    return o.transpose(0, 2, 1, 3, 4).reshape(b, t, h, d)


def check_mgpu_prefill(q, kv: PagedKV, config: MgpuPrefillConfig = H100_MGPU_PREFILL) -> None:
    """Raises ValueError naming what this kernel does not support (the decode kernel's
    `check_mgpu_options`, with the SMEM of a tile's positions)."""
    check_mgpu_options(q, kv, config, name="paged_prefill_mgpu", extra_smem=ROWS * 4)


def paged_prefill_mgpu(
    q: jax.Array,
    kv: PagedKV,
    positions: jax.Array,
    seq_lens: jax.Array,
    page_table: jax.Array,
    *,
    window: jax.Array | int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    config: MgpuPrefillConfig = H100_MGPU_PREFILL,
    interpret: bool = False,
) -> jax.Array:
    """Causal attention of a ragged chunk of new tokens per row against its pages (Mosaic GPU).

    The arguments and result of `triton_prefill.paged_prefill_attention` (whose docstring
    describes them), with `config` an `MgpuPrefillConfig`. `interpret=True` runs Mosaic GPU's
    interpreter on the CPU. Raises ValueError for f32 queries and what `check_mgpu_prefill` names.
    """
    check_prefill_inputs(q, kv, positions, seq_lens, page_table, window, softcap, scale)
    check_mgpu_prefill(q, kv, config)
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


reference = prefill_reference
"""The pure-jnp definition the Mosaic GPU prefill kernel is held to (`attention/reference.py`, the one
definition the family shares; tests/pallas_kernels/attention/ compare against it)."""
