"""Random paged KV pools and page tables for the kernel tests (imported by the test files here)."""

from __future__ import annotations

import zlib

import jax.numpy as jnp
import numpy as np

from jaxserve.layers import kv_cache as kvc

# Absolute tolerances against the f32 reference. f32 queries: the kernel differs only in summation
# order. bf16 queries: the kernel rounds the probabilities to bf16 before P.V (as FlashAttention
# does) and returns bf16, so ~2^-8 relative error on outputs of magnitude <~ 1.
ATOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}
ATOL_QUANTIZED_F32 = 1e-4  # int8/fp8 pages with f32 queries: same dequantized values, scale order


def make_pool(rng, layers, kvh, pages, ps, d, kv_cache_dtype, model_dtype):
    """(k, v, k_scale, v_scale) with random contents, quantized like `kv_cache.write` does."""
    kf = jnp.asarray(rng.standard_normal((layers, kvh, pages, ps, d)), jnp.float32)
    vf = jnp.asarray(rng.standard_normal((layers, kvh, pages, ps, d)), jnp.float32)
    if kv_cache_dtype == "auto":
        return kf.astype(model_dtype), vf.astype(model_dtype), None, None
    dt = kvc.storage_dtype(kv_cache_dtype, model_dtype)
    k, ks = kvc.quantize(kf, dt)
    v, vs = kvc.quantize(vf, dt)
    return k, v, ks, vs


def permuted_page_table(rng, batch, width, pages):
    """i32[batch, width]: distinct random pages per row, drawn from a permutation of the pool."""
    assert batch * width <= pages
    return jnp.asarray(rng.permutation(pages)[: batch * width].reshape(batch, width), jnp.int32)


def tolerance(q_dtype, kv_cache_dtype):
    if q_dtype == jnp.float32 and kv_cache_dtype != "auto":
        return ATOL_QUANTIZED_F32
    return ATOL[q_dtype]


def pairwise_covered(cases, names):
    """Asserts every pair of parameter values appears together in some case (the tests' design)."""
    values = [sorted({c[i] for c in cases}, key=str) for i in range(len(names))]
    missing = []
    for i in range(len(names)):
        for j in range(i + 1, len(names)):
            seen = {(c[i], c[j]) for c in cases}
            missing += [
                (names[i], a, names[j], b)
                for a in values[i]
                for b in values[j]
                if (a, b) not in seen
            ]
    return missing


def np_seed(*parts) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(parts).encode()))
