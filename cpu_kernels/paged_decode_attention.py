"""Paged decode attention on XLA's CPU backend: a C++ kernel called through XLA's FFI.

    paged_decode_attention(q, k_pages, v_pages, kv_lens, page_table, layer, k_scale, v_scale,
                           window=, softcap=, scale=) -> [B, H, D]

One query token per row (decode), against the row's pages of the whole stacked pool
[L, KVH, P, ps, D] read in place at the traced `layer`. The kernel (`paged_decode_attention.cc`
beside this file) runs an online softmax per (row, KV head) in f32, page by page, over the row's
visible keys only (kv_len - window .. kv_len - 1 under a window), on XLA's intra-op thread pool.
Why a C++ kernel on CPU: XLA's CPU backend has no fast form of this computation. Its best plain-XLA
form (`jaxserve/layers/ragged_attention.py`) gathers and converts every live page to f32 and runs
one tiny batched dot per page; this reads each K/V row once (RESULTS.md section 37).

`paged_decode_attention_reference` at the end of this file is the pure-jnp definition (the
decode case of the Pallas kernels' reference, which the engine's every path is tested against);
tests compare the two (tests/cpu_kernels/). The kernel is compiled on first use (`build.py`:
`$CXX -O3 -march=native`, cached in `$JAXSERVE_CACHE_DIR/cpu_kernels/`); `available()` says
whether that worked (and `build_error()` why not), and the engine falls back to the XLA path when
it did not (`jaxserve.resolve`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels.build import BuildError, FfiTarget
from pallas_kernels.paged_attention import paged_attention_reference

TARGET = "jaxserve_paged_decode_attention"
KERNEL = FfiTarget("paged_decode_attention.cc", TARGET, "JaxservePagedDecodeAttention")


def available() -> bool:
    """Whether the kernel is compiled and registered for the CPU backend (builds it if needed)."""
    return KERNEL.error() is None


def build_error() -> str | None:
    """Why the kernel is not available, or None when it is."""
    return KERNEL.error()


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
    err = KERNEL.error()
    if err is not None:
        raise BuildError(f"the CPU paged decode attention kernel is not available: {err}")
    b, h, d = q.shape
    if k_pages.ndim != 5 or k_pages.shape[-1] != d or h % k_pages.shape[1]:
        raise ValueError(f"pools {k_pages.shape} do not fit q {q.shape}")
    if (k_scale is None) != (v_scale is None):
        raise ValueError("pass both k_scale and v_scale, or neither")
    empty = jnp.zeros((0,), jnp.float32)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(
        q,
        k_pages,
        v_pages,
        empty if k_scale is None else k_scale.astype(jnp.float32),
        empty if v_scale is None else v_scale.astype(jnp.float32),
        kv_lens.astype(jnp.int32),
        page_table.astype(jnp.int32),
        jnp.asarray(layer, jnp.int32),
        jnp.asarray(0 if window is None else window, jnp.int32),
        scale=np.float32(1.0 / np.sqrt(d) if scale is None else scale),
        softcap=np.float32(0.0 if softcap is None else softcap),
    )


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
    """The definition: the paged attention reference (`pallas_kernels.paged_attention`, gather +
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
