"""The one paged-KV argument of every attention kernel and reference (`PagedKV`), their input
checks, and the logit options they share. Jax only, no Pallas: the C++ CPU kernels take it too.

Every form of the family (`triton_*`, `mgpu_*`, `xla`, `reference`, `cpu_kernels.
paged_decode_attention`) is called the same way:

    decode:   f(q [B, H, D],    kv: PagedKV, kv_lens i32[B], page_table i32[B, W], *, options)
    prefill:  f(q [B, T, H, D], kv: PagedKV, positions i32[B, T], seq_lens i32[B],
                page_table i32[B, W], *, options)

The logit options, the same in the references, the XLA forms and every kernel:

    s = (q . k) * scale                  scale (static) = 1 / sqrt(D) when None
    s = softcap * tanh(s / softcap)      Gemma 2 soft-capping, when softcap (static) is not None
    key p visible to the query at t  iff  p <= t, p < seq_len and (window <= 0 or t - p < window)

`window` is a traced i32[] (scanned with the layers), so one compiled program serves sliding and
global layers alike; window <= 0 (or None) is global attention, bit-for-bit the same as no window.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# Finite, so fully masked tiles never produce inf - inf = NaN in the kernels' online softmax.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
QUANTIZED_KV_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))


class PagedKV(NamedTuple):
    """The whole stacked KV pool and the layer to read: the kernels take every layer's pages and a
    traced `layer`, so the model calls them inside `lax.scan` without slicing (and copying) a
    layer out of the cache. A pytree: it goes through jit, scan and shard_map as it is."""

    k_pages: jax.Array  # [L, KVH, P, ps, D]    model dtype, int8 or fp8
    v_pages: jax.Array  # [L, KVH, P, ps, D]    k_pages' shape and dtype
    k_scale: jax.Array | None = None  # f32[L, KVH, P, ps]  per-token scales, exactly for int8/fp8
    v_scale: jax.Array | None = None  # f32[L, KVH, P, ps]
    layer: jax.Array | int = 0  # i32[] | int  which layer of the pool (traced inside lax.scan)

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None


def traced(kv: PagedKV, window) -> tuple[PagedKV, jax.Array]:
    """(kv with its layer an i32[], the window an i32[]; None: 0, global), as the kernels' jitted
    calls take them: traced, so one program serves every layer and window."""
    layer = jnp.asarray(kv.layer, jnp.int32).reshape(())
    window = jnp.asarray(0 if window is None else window, jnp.int32).reshape(())
    return kv._replace(layer=layer), window


def kernel_scalars(kv: PagedKV, window) -> jax.Array:
    """i32[2] (layer, window): the scalars a kernel reads at run time."""
    return jnp.stack([jnp.asarray(kv.layer, jnp.int32), jnp.asarray(window, jnp.int32)]).reshape(2)


def pool_operands(kv: PagedKV) -> list[jax.Array]:
    """The pool as the kernels' refs read it, one page per leading index: K, V [L * KVH * P, ps, D]
    (bitcasts, not copies), then for int8/fp8 pages K, V scales f32[L * KVH * P, ps]."""
    n_layers, kvh, n_pages, ps, d = kv.k_pages.shape
    rows = n_layers * kvh * n_pages
    out = [kv.k_pages.reshape(rows, ps, d), kv.v_pages.reshape(rows, ps, d)]
    if kv.quantized:
        out += [kv.k_scale.reshape(rows, ps), kv.v_scale.reshape(rows, ps)]
    return out


def window_start(query_pos, window):
    """First key position visible to a query at `query_pos` under `window` (i32[] or None; <= 0 =
    global): max(query_pos - window + 1, 0), or 0 for a global layer."""
    if window is None:
        return jnp.zeros_like(query_pos)
    return jnp.where(window > 0, jnp.maximum(query_pos - window + 1, 0), 0)


def soft_cap(logits, softcap: float | None):
    """Gemma 2's logit soft-capping, s -> softcap * tanh(s / softcap); identity when None."""
    if softcap is None:
        return logits
    return softcap * jnp.tanh(logits / softcap)


def _is_concrete(x) -> bool:
    return x is not None and not isinstance(x, jax.core.Tracer)


def check_attention_options(window, softcap, scale) -> None:
    """Raises ValueError for a window that is not an integer scalar, or a non-positive cap/scale."""
    if window is not None and (
        jnp.shape(window) not in ((), (1,))
        or not jnp.issubdtype(jnp.result_type(window), jnp.integer)
    ):
        raise ValueError(f"window must be an integer scalar (<= 0 = global), got {window!r}")
    for name, v in (("softcap", softcap), ("scale", scale)):
        if v is not None and not (isinstance(v, (int, float)) and v > 0):
            raise ValueError(f"{name} must be a positive Python float or None, got {v!r}")


def check_decode_inputs(q, kv: PagedKV, seq_lens, page_table, window, softcap, scale) -> None:
    """A decode kernel's checks: q f32/bf16 [B, H, D], then `check_kv_inputs` and the options."""
    if q.ndim != 3 or q.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"q must be f32/bf16 [B, H, D], got {q.dtype}{list(q.shape)}")
    b, h, d = q.shape
    check_kv_inputs(h, d, kv, seq_lens, page_table, b)
    check_attention_options(window, softcap, scale)


def check_prefill_inputs(
    q, kv: PagedKV, positions, seq_lens, page_table, window, softcap, scale
) -> None:
    """A prefill kernel's checks: q f32/bf16 [B, T, H, D], positions i32[B, T], then
    `check_kv_inputs` and the options."""
    if q.ndim != 4 or q.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"q must be f32/bf16 [B, T, H, D], got {q.dtype}{list(q.shape)}")
    b, t, h, d = q.shape
    if tuple(positions.shape) != (b, t) or positions.dtype != jnp.int32:
        raise ValueError(
            f"positions must be i32[{b}, {t}], got {positions.dtype}{list(positions.shape)}"
        )
    check_kv_inputs(h, d, kv, seq_lens, page_table, b)
    check_attention_options(window, softcap, scale)


def check_kv_inputs(
    num_q_heads: int, head_dim: int, kv: PagedKV, seq_lens, page_table, batch: int
) -> None:
    """Raises ValueError naming the bad argument and the shape it should have."""
    if not isinstance(kv, PagedKV):
        raise ValueError(f"kv must be a PagedKV, got {type(kv).__name__}")
    k_pages, v_pages, k_scale, v_scale, layer = kv
    if k_pages.ndim != 5:
        raise ValueError(
            f"k_pages must be [L, KVH, P, page_size, D], got shape {tuple(k_pages.shape)}"
        )
    n_layers, kvh, n_pages, ps, d = k_pages.shape
    if tuple(v_pages.shape) != tuple(k_pages.shape) or v_pages.dtype != k_pages.dtype:
        raise ValueError(
            f"v_pages must match k_pages: expected {k_pages.dtype}{list(k_pages.shape)}, "
            f"got {v_pages.dtype}{list(v_pages.shape)}"
        )
    if d != head_dim:
        raise ValueError(f"q head_dim {head_dim} does not match k_pages head_dim {d}")
    if num_q_heads % kvh:
        raise ValueError(
            f"q heads ({num_q_heads}) must be a multiple of the KV heads of k_pages ({kvh})"
        )
    for name, v in (("page_size", ps), ("head_dim", d)):
        if v & (v - 1):
            raise ValueError(f"k_pages {name} must be a power of two (Triton tiles), got {v}")
    if tuple(seq_lens.shape) != (batch,) or seq_lens.dtype != jnp.int32:
        raise ValueError(
            f"seq_lens must be i32[{batch}], got {seq_lens.dtype}{list(seq_lens.shape)}"
        )
    if page_table.ndim != 2 or page_table.shape[0] != batch or page_table.dtype != jnp.int32:
        raise ValueError(
            f"page_table must be i32[{batch}, W], got {page_table.dtype}{list(page_table.shape)}"
        )
    if jnp.shape(layer) not in ((), (1,)) or not jnp.issubdtype(
        jnp.result_type(layer), jnp.integer
    ):
        raise ValueError(f"layer must be an integer scalar, got {layer!r}")
    quantized = jnp.dtype(k_pages.dtype) in QUANTIZED_KV_DTYPES
    if quantized != (k_scale is not None) or (k_scale is None) != (v_scale is None):
        raise ValueError(
            f"k_scale and v_scale must be f32{list(k_pages.shape[:-1])} exactly when the pages "
            f"are int8/fp8 (k_pages is {k_pages.dtype}, k_scale given: {k_scale is not None}, "
            f"v_scale given: {v_scale is not None})"
        )
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is not None and (
            tuple(s.shape) != tuple(k_pages.shape[:-1]) or s.dtype != jnp.float32
        ):
            raise ValueError(
                f"{name} must be f32{list(k_pages.shape[:-1])}, got {s.dtype}{list(s.shape)}"
            )
    # Values: checked only when concrete (inside jit they are tracers and cannot be inspected).
    if _is_concrete(layer) and not 0 <= int(np.asarray(layer).reshape(())) < n_layers:
        raise ValueError(f"layer {int(np.asarray(layer).reshape(()))} is outside [0, {n_layers})")
    w = page_table.shape[1]
    if _is_concrete(seq_lens):
        lens = np.asarray(seq_lens)
        if lens.min(initial=0) < 0 or lens.max(initial=0) > w * ps:
            raise ValueError(
                f"seq_lens must lie in [0, W * page_size] = [0, {w * ps}] for page_table "
                f"[{batch}, {w}], got max {lens.max(initial=0)} min {lens.min(initial=0)}"
            )
        if _is_concrete(page_table):
            pt = np.asarray(page_table)
            used = np.arange(w)[None, :] < -(-lens[:, None] // ps)  # (B, W) pages holding tokens
            bad = used & ((pt < 0) | (pt >= n_pages))
            if bad.any():
                b, j = map(int, np.argwhere(bad)[0])
                raise ValueError(
                    f"page_table[{b}, {j}] = {int(pt[b, j])} points past the pool of {n_pages} "
                    f"pages (k_pages [L, KVH, P={n_pages}, ps, D])"
                )
