"""The paged KV cache: a pool of fixed-size pages per layer, written through a slot mapping.

Layout (one array for K, one for V, every layer stacked so the model can scan over layers):

    k, v:        [num_layers, num_kv_heads, num_pages, page_size, head_dim]   model dtype | int8 | fp8
    k_scale,
    v_scale:     [num_layers, num_kv_heads, num_pages, page_size]  f32   (only for int8 / fp8)

A sequence owns a list of pages (its row of the page table, i32[max_pages_per_seq]); token position
`p` of that sequence lives in page `page_table[p // page_size]` at offset `p % page_size`. The flat
*slot* of that token is `page * page_size + offset`; the runner hands the model one slot per new token
(`slot_mapping`), and -1 marks padding tokens, whose writes are dropped. No sequence reserves
contiguous memory: pages come from a host-side free list (`page_allocator.py`) as sequences grow.

Quantized caches store one scale per (token, KV head): int8 uses amax/127 with rounding, fp8 (e4m3)
uses amax/448. Attention multiplies K's scale into the logits and V's scale into the probabilities
(see `pallas_kernels/`), so dequantized pages are never materialized on the kernel path.

Keeping the layer axis inside the arrays (rather than a list of per-layer arrays) lets the model
update the cache in place inside `lax.scan` when the runner donates it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

FP8_DTYPE = jnp.float8_e4m3fn
_QMAX = {"int8": 127.0, "fp8": 448.0}


@struct.dataclass
class KVCache:
    k: jax.Array  # [L, KVH, P, page_size, D]
    v: jax.Array  # [L, KVH, P, page_size, D]
    k_scale: jax.Array | None  # f32[L, KVH, P, page_size] for int8/fp8, else None
    v_scale: jax.Array | None  # f32[L, KVH, P, page_size] for int8/fp8, else None

    @property
    def num_pages(self) -> int:
        return self.k.shape[2]

    @property
    def page_size(self) -> int:
        return self.k.shape[3]

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None


def storage_dtype(kv_cache_dtype: str, model_dtype) -> jnp.dtype:
    """The element dtype of the pages for an EngineConfig.kv_cache_dtype."""
    if kv_cache_dtype == "auto":
        return jnp.dtype(model_dtype)
    if kv_cache_dtype == "int8":
        return jnp.dtype(jnp.int8)
    if kv_cache_dtype == "fp8":
        return jnp.dtype(FP8_DTYPE)
    raise ValueError(f"kv_cache_dtype must be 'auto', 'int8' or 'fp8', got {kv_cache_dtype!r}")


# Pallas' Triton lowering indexes an array under 4 GiB with 32-bit signed offsets, so a one-byte
# (int8 / fp8) pool array of 2^31 or more elements that is still under 4 GiB reads the wrong pages
# (seen on the H200: experiments/JOURNAL.md 48). Wider dtypes cannot fall in that range.
TRITON_OFFSET_LIMIT = 2**31


def triton_safe_num_pages(num_pages: int, page_elements: int, itemsize: int, shards: int = 1):
    """The most pages, at most `num_pages`, whose pool array on one device stays out of the
    range the Pallas Triton kernels misread: under 2^31 elements, or 4 GiB and over.

    page_elements: elements one page holds in one device's array (layers x local KV heads x
    page_size x head_dim); shards: the data shards the pages are split over (each holds an equal
    share)."""
    local = num_pages // shards
    elements = local * page_elements
    if elements < TRITON_OFFSET_LIMIT or elements * itemsize >= 2 * TRITON_OFFSET_LIMIT:
        return num_pages
    return (TRITON_OFFSET_LIMIT - 1) // page_elements * shards


def bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: str, model_dtype
) -> int:
    """KV bytes one token occupies across all layers (K and V, scales included)."""
    elem = storage_dtype(kv_cache_dtype, model_dtype).itemsize
    per_head = head_dim * elem + (4 if kv_cache_dtype in _QMAX else 0)
    return 2 * num_layers * num_kv_heads * per_head


def init(
    num_layers: int,
    num_kv_heads: int,
    num_pages: int,
    page_size: int,
    head_dim: int,
    kv_cache_dtype: str,
    model_dtype,
) -> KVCache:
    """An all-zero cache. Page contents are garbage until written; lengths decide what is read."""
    dt = storage_dtype(kv_cache_dtype, model_dtype)
    shape = (num_layers, num_kv_heads, num_pages, page_size, head_dim)
    scales = None
    if kv_cache_dtype in _QMAX:
        scales = jnp.zeros(shape[:-1], jnp.float32)
    return KVCache(
        k=jnp.zeros(shape, dt),
        v=jnp.zeros(shape, dt),
        k_scale=scales,
        v_scale=None if scales is None else jnp.zeros(shape[:-1], jnp.float32),
    )


def quantize(x: jax.Array, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """Per-vector symmetric quantization over the last axis. x[..., D] -> (q[..., D], f32 scale[...])."""
    kind = "int8" if dtype == jnp.int8 else "fp8"
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    scale = jnp.maximum(amax / _QMAX[kind], 1e-12)
    y = x / scale[..., None]
    if kind == "int8":
        q = jnp.clip(jnp.round(y), -127, 127).astype(jnp.int8)
    else:
        q = jnp.clip(y, -448.0, 448.0).astype(FP8_DTYPE)
    return q, scale


def dequantize(q: jax.Array, scale: jax.Array | None, dtype=jnp.float32) -> jax.Array:
    """Inverse of `quantize` (identity cast when scale is None)."""
    if scale is None:
        return q.astype(dtype)
    return (q.astype(jnp.float32) * scale[..., None]).astype(dtype)


def write(
    cache: KVCache, layer: jax.Array, k_new: jax.Array, v_new: jax.Array, slot_mapping: jax.Array
) -> KVCache:
    """Writes new K/V of one layer into their slots. Pure: returns the updated cache.

    layer:        i32[]  (traced: the scan index)
    k_new, v_new: [B, T, KVH, D]
    slot_mapping: i32[B, T]  flat slot (page * page_size + offset), -1 = padding (dropped)
    """
    b, t, kvh, d = k_new.shape
    ps = cache.page_size
    slots = slot_mapping.reshape(b * t)
    valid = slots >= 0
    page = jnp.where(valid, slots // ps, cache.num_pages)  # out of bounds -> dropped
    off = jnp.where(valid, slots % ps, 0)
    k_new = k_new.reshape(b * t, kvh, d)  # (N, KVH, D)
    v_new = v_new.reshape(b * t, kvh, d)
    if cache.quantized:
        kq, ks = quantize(k_new, cache.k.dtype)
        vq, vs = quantize(v_new, cache.v.dtype)
        return KVCache(
            k=cache.k.at[layer, :, page, off].set(kq, mode="drop"),
            v=cache.v.at[layer, :, page, off].set(vq, mode="drop"),
            k_scale=cache.k_scale.at[layer, :, page, off].set(ks, mode="drop"),
            v_scale=cache.v_scale.at[layer, :, page, off].set(vs, mode="drop"),
        )
    return KVCache(
        k=cache.k.at[layer, :, page, off].set(k_new.astype(cache.k.dtype), mode="drop"),
        v=cache.v.at[layer, :, page, off].set(v_new.astype(cache.v.dtype), mode="drop"),
        k_scale=None,
        v_scale=None,
    )
