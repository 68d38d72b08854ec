"""Paged attention on XLA's CPU backend, decode and prefill: a C++ kernel called through XLA's FFI.

    paged_decode_attention(q, kv, kv_lens, page_table, window=, softcap=, scale=) -> [B, H, D]
    paged_prefill_attention(q, kv, positions, seq_lens, page_table, window=, softcap=, scale=)
        -> [B, T, H, D]

kv is the attention family's `PagedKV` (`pallas_kernels/attention/paged_kv.py`: the pools, their
scales, the layer), the argument every attention kernel takes.

One query token per row (decode), against the row's pages of the whole stacked pool
[L, KVH, P, ps, D] read in place at the traced `layer`: the kernel (`paged_decode_attention.cc`
beside this file) runs an online softmax per (row, KV head) in f32, page by page, over the row's
visible keys only (kv_len - window .. kv_len - 1 under a window), on XLA's intra-op thread pool.
Prefill chunks (T query tokens per row, causal) take a second handler of the same file: work items
of (row, KV head, 16 query tokens) convert each tile of 128 keys to f32 once for all their query
vectors, compute the scores (a query against 16 keys at a time with AVX-512, else 4 x 2
register blocks; decode items run the same routines on their pages) and run the online softmax
over each query's own visible keys, so a token's result does not depend on its chunk, the other rows or the
page-table width (no padded [W * ps] block, no mask over invisible keys).
Why C++ on CPU: XLA's CPU backend has no fast form of this computation. Its best plain-XLA forms
(`pallas_kernels/attention/xla.py`) gather and convert every live page to f32 and run tiny
batched dots; these read each K/V row once per item (JOURNAL.md sections 37 and 39).

The definitions the handlers are held to (tests/cpu_kernels/) are the family's pure-jnp references
(`pallas_kernels/attention/reference.py`, jax only, which every backend is tested against): the
decode handler's is `decode_reference`, the prefill handler's `paged_prefill_attention_reference`
at the end of this file (`prefill_reference`, with zeros at padding tokens). The kernels are
compiled on first use (`build.py`: `$CXX -O3 -march=native`, cached in
`$JAXSERVE_CACHE_DIR/cpu_kernels/`); `available()` says whether that worked (and `build_error()`
why not), and the engine falls back to the XLA paths when it did not (`jaxserve.resolve`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels.build import BuildError, FfiTarget
from pallas_kernels.attention.paged_kv import PagedKV
from pallas_kernels.attention.reference import prefill_reference

TARGET = "jaxserve_paged_decode_attention"
KERNEL = FfiTarget("paged_decode_attention.cc", TARGET, "JaxservePagedDecodeAttention")
PREFILL_TARGET = "jaxserve_paged_prefill_attention"
PREFILL_KERNEL = FfiTarget(
    "paged_decode_attention.cc", PREFILL_TARGET, "JaxservePagedPrefillAttention"
)


def available() -> bool:
    """Whether the kernels are compiled and registered for the CPU backend (builds them if
    needed)."""
    return build_error() is None


def build_error() -> str | None:
    """Why the kernels are not available, or None when they are."""
    return KERNEL.error() or PREFILL_KERNEL.error()


def paged_decode_attention(
    q: jax.Array,
    kv: PagedKV,
    kv_lens: jax.Array,
    page_table: jax.Array,
    *,
    window: jax.Array | int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
) -> jax.Array:
    """q [B, H, D] (f32 | bf16 | f16), kv's pools [L, KVH, P, ps, D] (f32 | bf16 | f16 | int8 |
    fp8 e4m3fn, with f32[L, KVH, P, ps] scales for int8 / fp8), kv_lens i32[B] (keys visible to
    each row's query, which sits at kv_len - 1; 0 = no key, zeros out), page_table i32[B, W]
    -> [B, H, D] in q.dtype: `reference.decode_reference`.

    window: i32[] | int | None (<= 0 = global); softcap, scale (static): as in the reference.
    CPU only (an FFI target registered for the CPU platform).
    """
    b, h, d = q.shape
    if page_table.ndim != 2 or page_table.shape[0] != b:
        raise ValueError(f"page_table {page_table.shape} does not fit q {q.shape}")
    index = (kv_lens.astype(jnp.int32), page_table.astype(jnp.int32))
    return _call(KERNEL, TARGET, q, kv, index, window, softcap, scale)


def _call(kernel, target, q, kv: PagedKV, index, window, softcap, scale):
    """The FFI call of either handler (their arguments differ only in `index`)."""
    err = kernel.error()
    if err is not None:
        raise BuildError(f"the CPU paged attention kernel is not available: {err}")
    k_pages, v_pages, k_scale, v_scale, layer = kv
    h, d = q.shape[-2:]
    if k_pages.ndim != 5 or k_pages.shape[-1] != d or h % k_pages.shape[1]:
        raise ValueError(f"pools {k_pages.shape} do not fit q {q.shape}")
    if (k_scale is None) != (v_scale is None):
        raise ValueError("pass both k_scale and v_scale, or neither")
    empty = jnp.zeros((0,), jnp.float32)
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(
        q,
        k_pages,
        v_pages,
        empty if k_scale is None else k_scale.astype(jnp.float32),
        empty if v_scale is None else v_scale.astype(jnp.float32),
        *index,
        jnp.asarray(layer, jnp.int32),
        jnp.asarray(0 if window is None else window, jnp.int32),
        scale=np.float32(1.0 / np.sqrt(d) if scale is None else scale),
        softcap=np.float32(0.0 if softcap is None else softcap),
    )


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
) -> jax.Array:
    """q [B, T, H, D], kv, positions i32[B, T], seq_lens i32[B], page_table i32[B, W] (the
    arguments of every prefill form of the family; the chunk's K/V already written to the pools)
    -> [B, T, H, D] in q.dtype: `paged_prefill_attention_reference`.

    A query at position p of row b sees keys s <= p (s >= p - window + 1 under a window). Query
    tokens at positions outside [0, seq_len_b) are padding and get zeros.
    """
    b, t, h, d = q.shape
    if positions.shape != (b, t) or seq_lens.shape != (b,) or page_table.shape[0] != b:
        raise ValueError(
            f"positions {positions.shape}, seq_lens {seq_lens.shape} and page_table "
            f"{page_table.shape} do not fit q {q.shape}"
        )
    index = tuple(x.astype(jnp.int32) for x in (positions, seq_lens, page_table))
    return _call(PREFILL_KERNEL, PREFILL_TARGET, q, kv, index, window, softcap, scale)


def paged_prefill_attention_reference(
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
    """The prefill handler's definition: the family's `prefill_reference` at every query token of
    the chunk, zeros at padding tokens (positions outside [0, seq_len))."""
    opts = dict(window=window, softcap=softcap, scale=scale)
    out = prefill_reference(q, kv, positions, seq_lens, page_table, **opts)
    real = (positions >= 0) & (positions < seq_lens[:, None])
    return jnp.where(real[:, :, None, None], out, jnp.zeros((), out.dtype))
