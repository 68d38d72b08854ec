"""Paged attention on XLA's CPU backend, decode and prefill: a C++ kernel called through XLA's FFI.

    paged_decode_attention(q, k_pages, v_pages, kv_lens, page_table, layer, k_scale, v_scale,
                           window=, softcap=, scale=) -> [B, H, D]
    paged_prefill_attention(q, k_pages, v_pages, positions, seq_lens, page_table, layer,
                            k_scale, v_scale, window=, softcap=, scale=) -> [B, T, H, D]

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

`paged_decode_attention_reference` and `paged_prefill_attention_reference` at the end of this
file are the pure-jnp definitions (the Pallas kernels' reference, which the engine's every path is
tested against); tests compare each handler with its own (tests/cpu_kernels/). The kernels are
compiled on first use (`build.py`: `$CXX -O3 -march=native`, cached in
`$JAXSERVE_CACHE_DIR/cpu_kernels/`); `available()` says whether that worked (and `build_error()`
why not), and the engine falls back to the XLA paths when it did not (`jaxserve.resolve`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels.build import BuildError, FfiTarget
from pallas_kernels.attention.triton_decode import paged_attention_reference

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
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    page_table: jax.Array,
    layer: jax.Array | int = 0,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    *,
    window: jax.Array | int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
) -> jax.Array:
    """q [B, H, D] (f32 | bf16 | f16), pools [L, KVH, P, ps, D] (f32 | bf16 | f16 | int8 | fp8
    e4m3fn, with f32[L, KVH, P, ps] scales for int8 / fp8), kv_lens i32[B] (keys visible to each
    row's query, which sits at kv_len - 1; 0 = no key, zeros out), page_table i32[B, W]
    -> [B, H, D] in q.dtype.

    window: i32[] | int | None (<= 0 = global); softcap, scale (static): as in the reference.
    CPU only (an FFI target registered for the CPU platform).
    """
    b, h, d = q.shape
    if page_table.ndim != 2 or page_table.shape[0] != b:
        raise ValueError(f"page_table {page_table.shape} does not fit q {q.shape}")
    index = (kv_lens.astype(jnp.int32), page_table.astype(jnp.int32))
    return _call(KERNEL, TARGET, q, k_pages, v_pages, k_scale, v_scale, index, layer, window,
                 softcap, scale)  # fmt: skip


def _call(kernel, target, q, k_pages, v_pages, k_scale, v_scale, index, layer, window, softcap,
          scale):  # fmt: skip
    """The FFI call of either handler (their arguments differ only in `index`)."""
    err = kernel.error()
    if err is not None:
        raise BuildError(f"the CPU paged attention kernel is not available: {err}")
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
    k_pages: jax.Array,
    v_pages: jax.Array,
    positions: jax.Array,
    seq_lens: jax.Array,
    page_table: jax.Array,
    layer: jax.Array | int = 0,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    *,
    window: jax.Array | int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
) -> jax.Array:
    """q [B, T, H, D], positions i32[B, T], seq_lens i32[B], page_table i32[B, W] (the arguments
    of `pallas_kernels.attention.triton_prefill.paged_prefill_attention`; the chunk's K/V already written to
    the pools) -> [B, T, H, D] in q.dtype.

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
    return _call(PREFILL_KERNEL, PREFILL_TARGET, q, k_pages, v_pages, k_scale, v_scale, index,
                 layer, window, softcap, scale)  # fmt: skip


def paged_decode_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    page_table: jax.Array,
    layer: jax.Array | int = 0,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    *,
    window: jax.Array | int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
) -> jax.Array:
    """The definition: the paged attention reference (`pallas_kernels.attention.triton_decode`, gather +
    einsum) for one query per row at position kv_len - 1, kv_len clipped to the page table.

    Row b's query sees keys s with s < kv_len_b and, under a window w > 0, s >= kv_len_b - w.
    Logits are `softcap * tanh(q.k * scale / softcap)` (no cap when softcap is None), scale
    defaulting to 1 / sqrt(D); a row with no visible key gives zeros.
    """
    lens = jnp.clip(kv_lens, 0, page_table.shape[1] * k_pages.shape[3])
    pos = jnp.maximum(lens - 1, 0)[:, None]  # (B, 1)
    out = paged_attention_reference(
        q[:, None], k_pages, v_pages, pos, lens, page_table, layer, k_scale, v_scale,
        window=window, softcap=softcap, scale=scale,
    )  # fmt: skip
    return out[:, 0]


def paged_prefill_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    positions: jax.Array,
    seq_lens: jax.Array,
    page_table: jax.Array,
    layer: jax.Array | int = 0,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    *,
    window: jax.Array | int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
) -> jax.Array:
    """The definition: the paged attention reference at every query token of the chunk, zeros at
    padding tokens (positions outside [0, seq_len))."""
    out = paged_attention_reference(
        q, k_pages, v_pages, positions, seq_lens, page_table, layer, k_scale, v_scale,
        window=window, softcap=softcap, scale=scale,
    )  # fmt: skip
    real = (positions >= 0) & (positions < seq_lens[:, None])
    return jnp.where(real[:, :, None, None], out, jnp.zeros((), out.dtype))
