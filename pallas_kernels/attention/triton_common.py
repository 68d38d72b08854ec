"""What the Triton paged-attention kernels share (`triton_decode`, `triton_prefill`): the
`pallas_call` over the whole KV pool (`paged_pallas_call`) and the shapes of the supported models'
attention for their CUDA lowering cases (`python -m pallas_kernels.check`). The `PagedKV` argument,
the input checks and the logit options are `paged_kv`'s.
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

from pallas_kernels.attention.paged_kv import PagedKV, kernel_scalars, pool_operands


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _whole(shape) -> pl.BlockSpec:
    """BlockSpec of an operand every program reads whole (scalars, lengths, page table, pool)."""
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def paged_pallas_call(
    kernel,
    blocks,
    kv: PagedKV,
    seq_lens,
    page_table,
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
    n_layers, kvh, n_pages, ps, d = kv.k_pages.shape
    pool = pool_operands(kv)
    in_specs = [_whole((2,)), _whole(seq_lens.shape), _whole(page_table.shape)]
    in_specs += [spec for _, spec in blocks] + [_whole(x.shape) for x in pool]
    args = [kernel_scalars(kv, window), seq_lens, page_table, *(x for x, _ in blocks), *pool]
    kernel = functools.partial(
        kernel,
        page_size=ps,
        num_kv_heads=kvh,
        num_pages=n_pages,
        quantized=kv.quantized,
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


def pool_structs(layers, kvh, pages, ps, d, q_dtype, kv_cache_dtype) -> PagedKV:
    """A `PagedKV` of ShapeDtypeStructs for a pool, its layer a traced i32[]."""
    sds = jax.ShapeDtypeStruct
    kv_dt = KV_DTYPES[kv_cache_dtype] or q_dtype
    kv = sds((layers, kvh, pages, ps, d), kv_dt)
    sc = None if KV_DTYPES[kv_cache_dtype] is None else sds((layers, kvh, pages, ps), jnp.float32)
    return PagedKV(kv, kv, sc, sc, sds((), jnp.int32))


class LoweringPool(NamedTuple):
    """One pool configuration the engine uses, for a kernel's `lowering_cases()`."""

    label: str  # "<model>/ps<page size>/<q dtype>/kv-<kv cache dtype>"
    heads: int  # query heads
    head_dim: int
    q_dtype: type  # jnp.bfloat16 or jnp.float32
    pool: PagedKV  # of ShapeDtypeStructs (`pool_structs`)
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
