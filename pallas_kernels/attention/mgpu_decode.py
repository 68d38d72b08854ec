"""Paged decode attention on Pallas Mosaic GPU (Hopper: TMA + wgmma), the successor of the Triton
`paged_attention` (jax 0.11 deprecates the Pallas Triton backend).

Same call, same semantics as `triton_decode.paged_attention` (one new query token per row
against that row's KV pages, the whole stacked pool and a traced `layer` in a `PagedKV`, GQA,
scale, soft-cap, traced sliding window, int8/fp8 pages with per-token scales). Dataflow of `paged_attention_mgpu`
(B rows, H = KVH * G query heads, pool of P pages of ps tokens, BK = block_k keys per step):

    q [B, H, D] -> [B, KVH, 64, D]        the G heads of one KV head, zero-padded to the 64 rows
                                          of a wgmma M tile (decode is memory-bound: the idle
                                          rows cost tensor-core cycles, not bandwidth)
    grid (B, KVH, S), one warpgroup per program (b, h, s), which walks its share of row b's key
    tiles (the same tiles, splits and window arithmetic as the Triton kernel, `decode_plan`):
        q tile [64, D]            TMA -> SMEM once
        per key tile n (ppb = BK / ps pages):
            page table entries     read as scalars from GMEM (page = pt[b, first + n * ppb + j])
            K, V pages [ps, D]     TMA -> slot n % NBUF of a multi-buffered SMEM ring [NBUF, BK, D]
                                   (one barrier per slot, arrived on by each of its page copies;
                                   tile n + NBUF is issued once tile n's products are done, so
                                   NBUF - 1 tiles are in flight while one is computed)
            int8/fp8 pages         the ring holds the raw pages; their f32 per-token scales go to
                                   SMEM by TMA too (ps >= 32) or as scalars (ps < 32: a page's
                                   scales are under the 128 bytes a warpgroup's TMA copy must
                                   move); the tile is loaded to registers, times its scales, and
                                   stored as bf16 into one SMEM slot the products read: no
                                   dequantized page ever reaches GMEM
            S = Q . K^T            wgmma [64, D] x [D, BK] -> f32 [64, BK] (K^T a transposed view
                                   of the ring slot)
            s = softcap(S * scale), masked to keys in [window start, kv_len): online softmax
                                   (running max m, sum l f32[64]) in registers
            P [64, BK] bf16        -> SMEM, O_tile = wgmma P . V [BK, D] -> f32 [64, D];
                                   o = o * exp(m_old - m_new) + O_tile
        o f32[64, D], m, l f32[64] -> SMEM (reusing the loop's SMEM) -> TMA -> GMEM partials
    combine over S (log-sum-exp, in XLA, as the Triton kernel) -> [B, KVH, 64, D] -> [B, H, D]

Both products read their operands from SMEM (wgmma's A may come from registers on the GPU, but
the Mosaic GPU interpret mode, which the tests run on CPU, only takes SMEM operands; the P tile is
8 KiB). The products run in bf16 with f32 accumulation; int8/fp8 values times their scale are
rounded to bf16 (the reference keeps them in f32: within the bf16 tolerance). Rows with seq_len 0
run no iterations and come out as zeros. Key pages past a row's length are clipped into the pool
and masked. Lowering semantics: Warpgroup (jax's default), one warpgroup per block, no
warp specialization. At the 8B decode shape ptxas reports 238 registers, no spills (sm_90a); head_dim
256 spills a few hundred bytes.

Refused with a ValueError (the Triton kernel or the reference serves them; `check_mgpu_decode`):
f32 queries (wgmma multiplies f32 only as tf32, short of the f32 kernels' accuracy), KV pages
other than bf16/int8/fp8, page sizes below 8 (TMA boxes of 8-row tiles), head dims other than 64,
128 or 256 (128-byte swizzled rows; wgmma N <= 256), GQA groups over 64 heads, and a config whose
SMEM exceeds the 227 KiB of a Hopper block.

The ring (`KVRing`, `kv_ring_scratch`), the online-softmax step (`attend`, `softmax_init`) and
`check_mgpu_options` are in `mgpu_common`: the Mosaic GPU prefill kernel (`mgpu_prefill`)
walks its key tiles with them too. The tiles are an `MgpuDecodeConfig` (`tuning`).

Interpret mode (CPU): `interpret=True` runs the kernel in Mosaic GPU's interpreter
(`plgpu.InterpretGPUParams()`, passed as `plgpu.kernel(interpret=...)`), which simulates SMEM,
TMA, barriers and wgmma.

The kernel is held to `reference.decode_reference`, the pure-jnp definition (gather + einsum).
"""

from __future__ import annotations

import dataclasses
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
    check_decode_inputs,
    kernel_scalars,
    pool_operands,
    traced,
)
from pallas_kernels.attention.reference import decode_reference
from pallas_kernels.attention.triton_decode import decode_plan
from pallas_kernels.attention.tuning import H100_MGPU_DECODE, MgpuDecodeConfig
from pallas_kernels.mgpu_common import ROWS, tiled_smem


def _decode_kernel(
    scalars_ref,  # i32[2]                   GMEM: (layer, window; <= 0 global)
    lens_ref,  # i32[B]                      GMEM
    pt_ref,  # i32[B, Wp]                    GMEM page table, padded to S * pages_per_split + ppb
    q_ref,  # bf16[B, KVH, 64, D]            GMEM
    k_ref,  # [L * KVH * P, ps, D]           GMEM: the whole K pool, one page per leading index
    v_ref,  # [L * KVH * P, ps, D]           GMEM
    *refs,  # (ks_ref, vs_ref f32[L * KVH * P, ps]), o_ref f32[B, KVH, S, 64, D], m_ref, l_ref
    page_size: int,
    block_k: int,
    pages_per_split: int,
    num_splits: int,
    num_buffers: int,
    num_kv_heads: int,
    num_pages: int,
    quantized: bool,
    sm_scale: float,
    softcap: float | None,
):
    if quantized:
        ks_ref, vs_ref, o_ref, m_ref, l_ref = refs
    else:
        ks_ref = vs_ref = None
        o_ref, m_ref, l_ref = refs
    b, h, s = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("s")
    ps, nbuf = page_size, num_buffers
    ppb = block_k // ps
    d = q_ref.shape[-1]
    cdt = q_ref.dtype  # bf16: the products' operand dtype

    kv_len = lens_ref[b]
    window = scalars_ref[1]
    windowed = window > 0
    base = (scalars_ref[0] * num_kv_heads + h) * num_pages  # first page of (layer, head)
    win_start = jnp.where(windowed, jnp.maximum(kv_len - window, 0), 0)  # first visible key
    first_page = win_start // ps
    n_blocks = pl.cdiv(pl.cdiv(kv_len, ps) - first_page, ppb)  # key tiles of the row
    bps = jnp.where(windowed, pl.cdiv(n_blocks, num_splits), pages_per_split // ppb)
    block0 = s * bps
    n_iter = jnp.maximum(jnp.minimum(bps, n_blocks - block0), 0)

    def tile_pages(i):
        """page_of of key tile i: page j -> its row in the pool (clipped: past-the-end pages
        are masked)."""
        page0 = first_page + (block0 + i) * ppb
        return lambda j: base + jnp.clip(pt_ref[b, page0 + j], 0, num_pages - 1)

    def loop_scope(q_smem, p_smem, k_smem, v_smem, raw, kv_bar, q_bar):
        ring = KVRing(k_ref, v_ref, ks_ref, vs_ref, k_smem, v_smem, raw, kv_bar, ps)
        plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_smem, q_bar)
        for i in range(nbuf):  # prologue: the ring's first tiles in flight
            pl.when(i < n_iter)(functools.partial(ring.issue, i, tile_pages(jnp.int32(i))))

        plgpu.barrier_wait(q_bar)

        def body(i, carry):
            slot = lax.rem(i, nbuf)
            k, v = ring.wait(slot, tile_pages(i))
            tok0 = (first_page + (block0 + i) * ppb) * ps
            carry = attend(
                carry,
                q_smem,
                k,
                v,
                p_smem,
                tok0,
                sm_scale=sm_scale,
                softcap=softcap,
                visible=lambda tok: (tok < kv_len) & (tok >= win_start),
            )

            @pl.when(i + nbuf < n_iter)
            def _():  # the slot's products are done: refill it with tile i + nbuf
                ring.issue(slot, tile_pages(i + nbuf))

            return carry

        return lax.fori_loop(0, n_iter, body, softmax_init(ROWS, d))

    o, m, l = pl.run_scoped(
        loop_scope,
        tiled_smem((ROWS, d), cdt),
        tiled_smem((ROWS, block_k), cdt),
        *kv_ring_scratch(nbuf, block_k, d, cdt, k_ref.dtype, ps),
        plgpu.Barrier(),
    )

    def store_scope(o_smem, m_smem, l_smem):
        o_smem[...] = o
        m_smem[...] = m
        l_smem[...] = l
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[b, h, s])
        plgpu.copy_smem_to_gmem(m_smem, m_ref.at[b, h, s])
        plgpu.copy_smem_to_gmem(l_smem, l_ref.at[b, h, s])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(
        store_scope,
        tiled_smem((ROWS, d), jnp.float32),
        plgpu.SMEM((ROWS,), jnp.float32),
        plgpu.SMEM((ROWS,), jnp.float32),
    )


@functools.partial(jax.jit, static_argnames=("softcap", "scale", "config", "interpret"))
def _decode_call(q, kv, seq_lens, page_table, window, softcap, scale, config, interpret):
    """Jitted Mosaic GPU kernel wrapper: q [B, H, D] -> [B, H, D]."""
    b, h, d = q.shape
    _, kvh, n_pages, ps, _ = kv.k_pages.shape
    g = h // kvh
    block_k = max(config.block_k, ps)
    ppb, splits, pps = decode_plan(
        b, kvh, page_table.shape[1], ps, dataclasses.replace(config, block_k=block_k)
    )
    wp = splits * pps + ppb  # a window's tiles start at its first page: one more tile of columns
    pt = jnp.pad(page_table, ((0, 0), (0, wp - page_table.shape[1])))
    qg = jnp.pad(q.reshape(b, kvh, g, d), ((0, 0), (0, 0), (0, ROWS - g), (0, 0)))
    args = [kernel_scalars(kv, window), seq_lens, pt, qg, *pool_operands(kv)]
    kernel = functools.partial(
        _decode_kernel,
        page_size=ps,
        block_k=block_k,
        pages_per_split=pps,
        num_splits=splits,
        num_buffers=config.num_buffers,
        num_kv_heads=kvh,
        num_pages=n_pages,
        quantized=kv.quantized,
        sm_scale=1.0 / math.sqrt(d) if scale is None else float(scale),
        softcap=None if softcap is None else float(softcap),
    )
    f32 = jnp.float32
    o, m, l = plgpu.kernel(
        kernel,
        out_type=(
            jax.ShapeDtypeStruct((b, kvh, splits, ROWS, d), f32),
            jax.ShapeDtypeStruct((b, kvh, splits, ROWS), f32),
            jax.ShapeDtypeStruct((b, kvh, splits, ROWS), f32),
        ),
        grid=(b, kvh, splits),
        grid_names=("b", "h", "s"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name=f"mgpu_paged_decode_ps{ps}_bk{block_k}_s{splits}",
    )(*args)
    # Log-sum-exp combine of the S partial results. Empty splits have l = 0 and m = f32.min.
    m_all = jnp.max(m, axis=2, keepdims=True)
    corr = jnp.exp(m - m_all)
    l_all = jnp.sum(l * corr, axis=2)
    o = jnp.sum(o * corr[..., None], axis=2)
    o = o / jnp.where(l_all > 0, l_all, 1.0)[..., None]  # inactive rows: 0 / 1 = 0
    return o[:, :, :g].reshape(b, h, d).astype(q.dtype)


def check_mgpu_decode(q, kv: PagedKV, config: MgpuDecodeConfig = H100_MGPU_DECODE) -> None:
    """Raises ValueError naming what this kernel does not support (`check_mgpu_options`)."""
    check_mgpu_options(q, kv, config)


def paged_attention_mgpu(
    q: jax.Array,
    kv: PagedKV,
    seq_lens: jax.Array,
    page_table: jax.Array,
    *,
    window: jax.Array | int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    config: MgpuDecodeConfig = H100_MGPU_DECODE,
    interpret: bool = False,
) -> jax.Array:
    """Decode attention of one new token per row against its pages (Mosaic GPU, Hopper).

    The arguments and result of `triton_decode.paged_attention` (whose docstring describes
    them), with `config` an `MgpuDecodeConfig`. `interpret=True` runs Mosaic GPU's interpreter
    on the CPU. Raises ValueError for f32 queries and the shapes `check_mgpu_decode` names.
    """
    check_decode_inputs(q, kv, seq_lens, page_table, window, softcap, scale)
    check_mgpu_decode(q, kv, config)
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


reference = decode_reference
"""The pure-jnp definition the Mosaic GPU decode kernel is held to (`attention/reference.py`, the one
definition the family shares; tests/pallas_kernels/attention/ compare against it)."""
