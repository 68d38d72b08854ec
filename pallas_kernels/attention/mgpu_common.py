"""What the Mosaic GPU attention kernels share (`mgpu_decode`, `mgpu_prefill`): their input check
(`check_mgpu_options`), the K/V page ring (`KVRing`, `kv_ring_scratch`) and the online-softmax step
(`attend`, `softmax_init`) with which both walk their key tiles. The SMEM layout, the wgmma M tile
and a Hopper block's SMEM are those of every Mosaic GPU kernel (`pallas_kernels/mgpu_common.py`)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.attention.paged_kv import MASK_VALUE, QUANTIZED_KV_DTYPES, PagedKV
from pallas_kernels.mgpu_common import ROWS, SMEM_BYTES, tiled_smem

LOG2E = math.log2(math.e)


def check_mgpu_options(
    q, kv: PagedKV, config, *, name: str = "paged_attention_mgpu", extra_smem: int = 0
) -> None:
    """Raises ValueError naming what the Mosaic GPU kernel `name` does not support; q is
    [..., H, D], `config` has block_k and num_buffers, `extra_smem` the kernel's SMEM beyond the
    ring, q and P tiles (`_attention_smem_bytes`)."""
    k_pages = kv.k_pages
    if q.dtype != jnp.bfloat16:
        raise ValueError(
            f"{name} supports bf16 queries only (wgmma bf16 x bf16 -> f32), got "
            f"{q.dtype}; f32 models use the Triton kernel or the reference"
        )
    h, d = q.shape[-2:]
    kvh, ps = k_pages.shape[1], k_pages.shape[3]
    if h // kvh > ROWS:
        raise ValueError(f"{name}: a GQA group of {h // kvh} heads exceeds {ROWS}")
    if d not in (64, 128, 256):
        raise ValueError(f"{name}: head_dim must be 64, 128 or 256, got {d}")
    block_k = max(config.block_k, ps)
    if ps < 8 or block_k % ps:
        raise ValueError(
            f"{name}: page_size must be a power of two >= 8 (TMA tiles of 8 rows), got {ps}"
        )
    kv_dt = jnp.dtype(k_pages.dtype)
    quantized = kv_dt in QUANTIZED_KV_DTYPES
    if not quantized and kv_dt != jnp.bfloat16:
        raise ValueError(f"{name}: KV pages must be bf16, int8 or fp8, got {kv_dt}")
    need = (
        _attention_smem_bytes(d, block_k, config.num_buffers, kv_dt.itemsize, quantized)
        + extra_smem
    )
    if need > SMEM_BYTES:
        raise ValueError(
            f"{name}: {need} bytes of SMEM (head_dim {d}, block_k {block_k}, "
            f"{config.num_buffers} buffers) exceed {SMEM_BYTES}; lower num_buffers or block_k"
        )


def _attention_smem_bytes(
    d: int, block_k: int, nbuf: int, kv_itemsize: int, quantized: bool
) -> int:
    """SMEM of the loop scope (the output scope after it reuses it; it is smaller)."""
    ring = 2 * nbuf * block_k * d * 2  # K, V bf16 ring
    if quantized:  # the raw pages' ring and their scales; one bf16 slot the dequantized tile
        ring = 2 * nbuf * block_k * (d * kv_itemsize + 4) + 2 * block_k * d * 2
    return ring + ROWS * d * 2 + ROWS * block_k * 2  # + q tile, P tile


# ------------------------------------------------------------------------------------------------
# The K/V page ring and the online-softmax step.


def scales_by_tma(page_size: int) -> bool:
    """Whether a page's f32 scales go to SMEM by TMA: a warpgroup's TMA copy moves multiples of
    128 bytes, so from ps = 32; smaller pages' scales are copied as scalars."""
    return page_size * 4 % 128 == 0


def kv_ring_scratch(nbuf: int, block_k: int, d: int, cdt, kv_dt, page_size: int) -> tuple:
    """The `pl.run_scoped` scratch of a `KVRing`: (k_smem, v_smem, raw, barriers). bf16 pages
    land in an nbuf-slot ring the products read; int8/fp8 pages land in the raw ring (kq, vq, ks,
    vs) and are dequantized into one bf16 slot. One barrier per slot, arrived on by its copies."""
    quantized = jnp.dtype(kv_dt) in QUANTIZED_KV_DTYPES
    raw, copies = None, 2
    if quantized:
        raw = (
            tiled_smem((nbuf, block_k, d), kv_dt),
            tiled_smem((nbuf, block_k, d), kv_dt),
            plgpu.SMEM((nbuf, block_k), jnp.float32),
            plgpu.SMEM((nbuf, block_k), jnp.float32),
        )
        copies = 4 if scales_by_tma(page_size) else 2
    slots = 1 if quantized else nbuf
    return (
        tiled_smem((slots, block_k, d), cdt),
        tiled_smem((slots, block_k, d), cdt),
        raw,
        plgpu.Barrier(num_arrivals=block_k // page_size * copies, num_barriers=nbuf),
    )


class KVRing(NamedTuple):
    """A program's key tiles: the GMEM pools [L * KVH * P, ps, D] (and f32 scales [.., ps] of
    int8/fp8 pools, else None) and the SMEM of `kv_ring_scratch`. `page_of(j)` maps page j of a
    tile (a Python int, or traced) to its pool row."""

    k_ref: Any
    v_ref: Any
    ks_ref: Any
    vs_ref: Any
    k_smem: Any
    v_smem: Any
    raw: Any
    bar: Any
    page_size: int

    def issue(self, slot, page_of) -> None:
        """TMA copies of a key tile's pages of K and V (and scales) into ring slot `slot`."""
        ps = self.page_size
        for j in range(self.k_smem.shape[1] // ps):
            pairs = ((self.k_ref, self.k_smem), (self.v_ref, self.v_smem))
            if self.raw is not None:
                kq_smem, vq_smem, ks_smem, vs_smem = self.raw
                pairs = ((self.k_ref, kq_smem), (self.v_ref, vq_smem))
                if scales_by_tma(ps):
                    pairs += ((self.ks_ref, ks_smem), (self.vs_ref, vs_smem))
            page = page_of(j)
            for src, dst in pairs:
                plgpu.copy_gmem_to_smem(
                    src.at[page], dst.at[slot, pl.ds(j * ps, ps)], self.bar.at[slot]
                )

    def wait(self, slot, page_of) -> tuple:
        """Waits for slot's tile; returns the bf16 K, V tiles [BK, D] in SMEM the products read.
        Int8/fp8 pages are loaded to registers, times their scales, and stored as bf16 into the
        one bf16 slot: no dequantized page ever reaches GMEM."""
        plgpu.barrier_wait(self.bar.at[slot])
        if self.raw is None:
            return self.k_smem.at[slot], self.v_smem.at[slot]
        kq_smem, vq_smem, ks_smem, vs_smem = self.raw
        ps, (block_k, d) = self.page_size, self.k_smem.shape[1:]
        if not scales_by_tma(ps):

            @pl.loop(0, block_k)
            def _(r):
                page = page_of(r // ps)
                ks_smem[slot, r] = self.ks_ref[page, r % ps]
                vs_smem[slot, r] = self.vs_ref[page, r % ps]

        for src, sc, dst in ((kq_smem, ks_smem, self.k_smem), (vq_smem, vs_smem, self.v_smem)):
            x = plgpu.load(src.at[slot], layout=plgpu.Layout.WGMMA)
            scale = plgpu.load(sc.at[slot], layout=plgpu.Layout.WGMMA.reduce(1))
            x = x.astype(jnp.float32) * lax.broadcast_in_dim(scale, (block_k, d), [0])
            dst.at[0][...] = x.astype(dst.dtype)
        plgpu.commit_smem()  # generic-proxy stores visible to wgmma's async proxy
        return self.k_smem.at[0], self.v_smem.at[0]


def softmax_init(rows: int, d: int) -> tuple:
    """(o f32[rows, D], m, l f32[rows]) of an empty online softmax, in wgmma's register layout."""
    return (
        plgpu.layout_cast(jnp.full((rows, d), 0, jnp.float32), plgpu.Layout.WGMMA),
        plgpu.layout_cast(
            jnp.full((rows,), jnp.finfo(jnp.float32).min, jnp.float32),
            plgpu.Layout.WGMMA.reduce(1),
        ),
        plgpu.layout_cast(jnp.full((rows,), 0, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
    )


def attend(carry, q_smem, k, v, p_smem, tok0, *, sm_scale, softcap, visible=None) -> tuple:
    """One key tile of the online softmax: S = Q . K^T (wgmma, K^T a transposed view of the
    tile), s = softcap(S * scale), masked to MASK_VALUE where `visible(tok)` is False (tok
    i32[rows, BK] the keys' positions tok0, tok0 + 1, ...; None: every key visible), P -> bf16
    p_smem, O = O * exp(m_old - m_new) + P . V. Returns the new (o, m, l)."""
    o, m, l = carry
    rows, block_k = p_smem.shape

    def qk(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, k.transpose((1, 0)))
        return acc_ref[...]

    logits = pl.run_scoped(qk, plgpu.ACC((rows, block_k), jnp.float32))
    logits = logits * sm_scale
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    if visible is not None:
        tok = tok0 + plgpu.broadcasted_iota(
            jnp.int32, (rows, block_k), 1, layout=plgpu.Layout.WGMMA
        )
        logits = jnp.where(visible(tok), logits, MASK_VALUE)
    m_new = jnp.maximum(m, logits.max(axis=1))
    corr = jnp.exp2((m - m_new) * LOG2E)
    p = jnp.exp2((logits - lax.broadcast_in_dim(m_new, logits.shape, [0])) * LOG2E)
    l_new = l * corr + p.sum(axis=1)
    p_smem[...] = p.astype(p_smem.dtype)
    plgpu.commit_smem()

    def pv(acc_ref):
        plgpu.wgmma(acc_ref, p_smem, v)
        return acc_ref[...]

    o = o * lax.broadcast_in_dim(corr, o.shape, [0]) + pl.run_scoped(
        pv, plgpu.ACC(o.shape, jnp.float32)
    )
    return o, m_new, l_new
