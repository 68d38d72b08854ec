"""What the paged-attention kernels share: input checks, the mask value, the logit options (sliding
window, soft-cap, scale), the `pallas_call` over the whole KV pool (`paged_pallas_call`) and the
shapes of the supported models' attention for the CUDA lowering cases (`python -m
pallas_kernels.check`).

The logit options, the same in the reference, the CPU ragged path and both kernels:

    s = (q . k) * scale                  scale = 1 / sqrt(D) when None
    s = softcap * tanh(s / softcap)      Gemma 2 soft-capping, only when softcap is not None
    key p visible to the query at t  iff  p <= t, p < seq_len and (window <= 0 or t - p < window)

`window` is a traced i32[] (scanned with the layers), so one compiled program serves sliding and
global layers alike; window <= 0 is global attention, bit-for-bit the same as no window.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

# Finite, so fully masked tiles never produce inf - inf = NaN in the online softmax.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
QUANTIZED_KV_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _is_concrete(x) -> bool:
    return x is not None and not isinstance(x, jax.core.Tracer)


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


def check_kv_inputs(
    num_q_heads: int,
    head_dim: int,
    k_pages,
    v_pages,
    seq_lens,
    page_table,
    layer,
    k_scale,
    v_scale,
    batch: int,
) -> None:
    """Raises ValueError naming the bad argument and the shape it should have."""
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


def _whole(shape) -> pl.BlockSpec:
    """BlockSpec of an operand every program reads whole (scalars, lengths, page table, pool)."""
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def paged_pallas_call(
    kernel,
    blocks,
    k_pages,
    v_pages,
    seq_lens,
    page_table,
    layer,
    k_scale,
    v_scale,
    window,
    *,
    softcap,
    scale,
    config,
    interpret,
    grid,
    out_specs,
    out_shape,
    name,
    **kernel_params,
):
    """The Triton `pallas_call` of a paged kernel over the whole stacked pool.

    `blocks` is the kernel's own (array, BlockSpec) operands, e.g. its query block; the kernel's
    refs come in this order, all but `blocks` read whole by every program:

        scalars      i32[2]                 (layer, window), traced
        seq_lens     i32[B]
        page_table   i32[B, Wp]             padded by the caller to what its kernel reads
        *blocks
        K, V pool    [L * KVH * P, ps, D]   k_pages, v_pages flattened (a bitcast, not a copy)
        K, V scale   f32[L * KVH * P, ps]   only for int8/fp8 pages

    `kernel` gets page_size, num_kv_heads, num_pages, quantized, sm_scale (1 / sqrt(D) when scale
    is None) and softcap from the pool and options, plus `kernel_params`; num_warps and num_stages
    come from `config`. Returns the outputs of `out_shape`.
    """
    n_layers, kvh, n_pages, ps, d = k_pages.shape
    rows = n_layers * kvh * n_pages
    kf = k_pages.reshape(rows, ps, d)  # (L * KVH * P, ps, D): a bitcast, not a copy
    vf = v_pages.reshape(rows, ps, d)
    quantized = k_scale is not None
    scalars = jnp.stack([jnp.asarray(layer, jnp.int32), jnp.asarray(window, jnp.int32)])
    in_specs = [_whole((2,)), _whole(seq_lens.shape), _whole(page_table.shape)]
    in_specs += [spec for _, spec in blocks] + [_whole((rows, ps, d)), _whole((rows, ps, d))]
    args = [scalars.reshape(2), seq_lens, page_table, *(x for x, _ in blocks), kf, vf]
    if quantized:
        in_specs += [_whole((rows, ps)), _whole((rows, ps))]
        args += [k_scale.reshape(rows, ps), v_scale.reshape(rows, ps)]
    kernel = functools.partial(
        kernel,
        page_size=ps,
        num_kv_heads=kvh,
        num_pages=n_pages,
        quantized=quantized,
        sm_scale=1.0 / float(np.sqrt(d)) if scale is None else float(scale),
        softcap=None if softcap is None else float(softcap),
        **kernel_params,
    )
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(
            num_warps=config.num_warps, num_stages=config.num_stages
        ),
        interpret=interpret,
        name=name,
    )(*args)


# (name, q heads, KV heads, head_dim, layers) of the supported models' attention.
MODEL_HEADS = (
    ("smollm2-135m", 9, 3, 64, 30),
    ("llama3.2-1b", 32, 8, 64, 16),
    ("llama3-8b", 32, 8, 128, 32),
    ("qwen2-7b", 28, 4, 128, 28),
)
# (name, q heads, KV heads, head_dim, layers, softcap, scale) of the sliding-window models'
# attention: Gemma 2 (logit soft-cap 50, scale query_pre_attn_scalar ** -0.5), Gemma 3 (no cap),
# Mistral (window only). Their lowering cases pass a traced window.
WINDOW_MODEL_HEADS = (
    ("gemma2-9b", 16, 8, 256, 42, 50.0, 256**-0.5),
    ("gemma2-27b", 32, 16, 128, 46, 50.0, 144**-0.5),
    ("gemma3-12b", 16, 8, 256, 48, None, 256**-0.5),
    ("mistral-7b", 32, 8, 128, 32, None, None),
)
KV_DTYPES = {"auto": None, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


def pool_structs(layers, kvh, pages, ps, d, q_dtype, kv_cache_dtype):
    """ShapeDtypeStructs of (k_pages, v_pages, k_scale, v_scale) for a pool."""
    sds = jax.ShapeDtypeStruct
    kv_dt = KV_DTYPES[kv_cache_dtype] or q_dtype
    kv = sds((layers, kvh, pages, ps, d), kv_dt)
    sc = None if KV_DTYPES[kv_cache_dtype] is None else sds((layers, kvh, pages, ps), jnp.float32)
    return kv, kv, sc, sc


class LoweringPool(NamedTuple):
    """One pool configuration the engine uses, for a kernel's `lowering_cases()`."""

    label: str  # "<model>/ps<page size>/<q dtype>/kv-<kv cache dtype>"
    heads: int  # query heads
    head_dim: int
    q_dtype: type  # jnp.bfloat16 or jnp.float32
    pool: tuple  # (k_pages, v_pages, k_scale, v_scale) of `pool_structs`
    window: dict | None  # {"softcap", "scale"} of a sliding-window model; None for a global one
    window_label: str  # "" or "/window[/softcapN]", the case name's suffix


def lowering_pools(pages: int) -> Iterator[LoweringPool]:
    """Models (MODEL_HEADS, then WINDOW_MODEL_HEADS) x page size x q dtype x KV dtype, for a pool
    of `pages` pages. A sliding-window model's cases pass a traced window (its soft-cap and scale
    static)."""
    models = [(*m, None) for m in MODEL_HEADS]
    models += [(*m, {"softcap": cap, "scale": sc}) for *m, cap, sc in WINDOW_MODEL_HEADS]
    for model, h, kvh, d, layers, window in models:
        suffix = ""
        if window is not None:
            cap = window["softcap"]
            suffix = "/window" + ("" if cap is None else f"/softcap{cap:g}")
        for ps in (16, 32):
            for q_dt in (jnp.bfloat16, jnp.float32):
                for kv in KV_DTYPES:
                    pool = pool_structs(layers, kvh, pages, ps, d, q_dt, kv)
                    label = f"{model}/ps{ps}/{jnp.dtype(q_dt).name}/kv-{kv}"
                    yield LoweringPool(label, h, d, q_dt, pool, window, suffix)
