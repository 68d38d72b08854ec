"""Random paged KV pools and page tables for the kernel tests (imported by the test files here)."""

from __future__ import annotations

import zlib

import jax.numpy as jnp
import numpy as np

from jaxserve.layers import kv_cache as kvc
from pallas_kernels.attention.paged_kv import PagedKV

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


def with_kv(args: dict) -> dict:
    """A kernel call's keyword arguments with the pool's (k_pages, v_pages, k_scale, v_scale,
    layer) gathered into its `kv` (the input checks' cases replace any one of them)."""
    rest = dict(args)
    fields = {f: rest.pop(f) for f in PagedKV._fields if f in rest}
    return {"kv": PagedKV(**fields), **rest}


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


def paged_from_dense(rng, kd, vd, ps, kv_cache_dtype="auto", model_dtype=jnp.float32, spare=3):
    """The dense sequences kd, vd f32[L, KVH, B, S, D] laid into a pool of page size `ps` over a
    permuted page table: (k, v, k_scale, v_scale, page_table i32[B, ceil(S / ps)]). The per-token
    quantization is the same whatever ps, so pools of different page sizes hold the same values."""
    kd, vd = np.asarray(kd, np.float32), np.asarray(vd, np.float32)
    layers, kvh, b, s, d = kd.shape
    w = -(-s // ps)
    pages = b * w + spare
    pt = np.asarray(permuted_page_table(rng, b, w, pages))

    def lay(x):
        x = np.pad(x, ((0, 0), (0, 0), (0, 0), (0, w * ps - s), (0, 0)))
        pool = np.zeros((layers, kvh, pages, ps, d), np.float32)
        pool[:, :, pt] = x.reshape(layers, kvh, b, w, ps, d)
        return jnp.asarray(pool)

    k, v = lay(kd), lay(vd)
    if kv_cache_dtype == "auto":
        return k.astype(model_dtype), v.astype(model_dtype), None, None, jnp.asarray(pt)
    dt = kvc.storage_dtype(kv_cache_dtype, model_dtype)
    kq, ks = kvc.quantize(k, dt)
    vq, vs = kvc.quantize(v, dt)
    return kq, vq, ks, vs, jnp.asarray(pt)


def naive_attention(q, k, v, ks, vs, pt, positions, seq_lens, layer, window, softcap, scale):
    """Loop-by-loop numpy definition of windowed, soft-capped paged attention (f64): q [B, T, H, D]
    -> [B, T, H, D]. Key p is visible to query position t iff p <= t, p < seq_len and (window <= 0
    or t - p < window); a query with no visible key gives zeros."""
    q = np.asarray(q, np.float64)
    b, t, h, d = q.shape
    kvh = k.shape[1]
    pt = np.asarray(pt)

    def dense(pool, sc):  # (KVH, B, W * ps, D)
        x = np.asarray(pool[layer].astype(jnp.float32), np.float64)[:, pt]
        if sc is not None:
            x = x * np.asarray(sc[layer], np.float64)[:, pt][..., None]
        return x.reshape(kvh, b, -1, d)

    kd, vd = dense(k, ks), dense(v, vs)
    scale = d**-0.5 if scale is None else scale
    out = np.zeros((b, t, h, d))
    for bi in range(b):
        for ti in range(t):
            pos = int(positions[bi, ti])
            keys = [
                p
                for p in range(kd.shape[2])
                if p <= pos and p < int(seq_lens[bi]) and (window <= 0 or pos - p < window)
            ]
            if not keys:
                continue
            for hi in range(h):
                kh = hi // (h // kvh)
                s = kd[kh, bi, keys] @ q[bi, ti, hi] * scale
                if softcap is not None:
                    s = softcap * np.tanh(s / softcap)
                p = np.exp(s - s.max())
                out[bi, ti, hi] = (p / p.sum()) @ vd[kh, bi, keys]
    return out
