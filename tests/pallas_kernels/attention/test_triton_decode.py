"""Decode kernel (interpret mode) against `decode_reference`, plus its input checks.

The parameter product (q dtype x KV dtype x page size x head_dim x GQA group x tiling) is covered
pairwise by 12 cases; every case batches the lengths 0, 1, ps-1, ps, ps+1 and the maximum (the
whole page table) as separate rows of one call, over a randomly permuted page table.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_kv_testing import (
    make_pool,
    np_seed,
    pairwise_covered,
    permuted_page_table,
    tolerance,
    with_kv,
)

from pallas_kernels.attention.paged_kv import PagedKV
from pallas_kernels.attention.reference import decode_reference
from pallas_kernels.attention.triton_decode import paged_attention
from pallas_kernels.attention.tuning import DecodeConfig

# jax warns on every Triton-backend pallas_call (upstream deprecation).
pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


DT = {"f32": jnp.float32, "bf16": jnp.bfloat16}
# "small" tiles force several key blocks per program and several splits (split-K combine).
TILES = {
    "h200": DecodeConfig(),
    "small": DecodeConfig(block_k=16, max_splits=4, target_programs=1 << 20),
}
NAMES = ("q", "kv", "ps", "d", "group", "tiles")
CASES = [
    ("bf16", "auto", 32, 128, 1, "h200"),
    ("bf16", "fp8", 16, 64, 4, "h200"),
    ("bf16", "fp8", 32, 64, 8, "small"),
    ("bf16", "fp8", 8, 64, 1, "h200"),
    ("bf16", "int8", 16, 128, 3, "small"),
    ("bf16", "int8", 32, 128, 4, "small"),
    ("bf16", "int8", 8, 128, 8, "h200"),
    ("f32", "auto", 16, 128, 8, "h200"),
    ("f32", "auto", 8, 128, 4, "small"),
    ("f32", "auto", 8, 64, 3, "small"),
    ("f32", "fp8", 32, 128, 3, "h200"),
    ("f32", "int8", 16, 64, 1, "small"),
]
KVH, LAYERS, WIDTH = 2, 2, 5


def test_cases_cover_every_pair():
    assert pairwise_covered(CASES, NAMES) == []


@pytest.mark.parametrize(NAMES, CASES)
def test_decode_matches_reference(q, kv, ps, d, group, tiles):
    rng = np_seed("decode", q, kv, ps, d, group, tiles)
    dtype = DT[q]
    lens = np.array([0, 1, ps - 1, ps, ps + 1, WIDTH * ps], np.int32)
    b, h = len(lens), KVH * group
    pages = b * WIDTH + 3
    k, v, ks, vs = make_pool(rng, LAYERS, KVH, pages, ps, d, kv, dtype)
    pt = permuted_page_table(rng, b, WIDTH, pages)
    qa = jnp.asarray(rng.standard_normal((b, h, d)), jnp.float32).astype(dtype)
    seq_lens = jnp.asarray(lens)

    pool = PagedKV(k, v, ks, vs, 1)
    out = paged_attention(qa, pool, seq_lens, pt, config=TILES[tiles], interpret=True)
    ref = decode_reference(qa, pool, seq_lens, pt)

    assert out.shape == (b, h, d) and out.dtype == dtype
    out32 = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out32).all()
    assert (out32[0] == 0).all()  # seq_len 0: zeros, never NaN
    np.testing.assert_allclose(
        out32, np.asarray(ref.astype(jnp.float32)), atol=tolerance(dtype, kv), rtol=0
    )


def test_decode_reads_the_given_layer_under_jit():
    rng = np_seed("decode-layer")
    k, v, _, _ = make_pool(rng, 3, 1, 8, 8, 64, "auto", jnp.float32)
    q = jnp.asarray(rng.standard_normal((2, 1, 64)), jnp.float32)
    pt = permuted_page_table(rng, 2, 4, 8)
    lens = jnp.asarray([5, 30], jnp.int32)
    run = jax.jit(
        lambda layer: paged_attention(q, PagedKV(k, v, layer=layer), lens, pt, interpret=True)
    )
    for layer in (0, 2):
        ref = decode_reference(q, PagedKV(k, v, layer=layer), lens, pt)
        np.testing.assert_allclose(run(jnp.int32(layer)), ref, atol=2e-5)


def _args(**over):
    a = dict(
        q=jnp.zeros((2, 4, 64), jnp.float32),
        k_pages=jnp.zeros((1, 2, 8, 16, 64), jnp.float32),
        v_pages=jnp.zeros((1, 2, 8, 16, 64), jnp.float32),
        seq_lens=jnp.asarray([3, 20], jnp.int32),
        page_table=jnp.asarray([[0, 1], [2, 3]], jnp.int32),
    )
    a.update(over)
    return a


@pytest.mark.parametrize(
    "over, match",
    [
        (dict(q=jnp.zeros((2, 4, 32), jnp.float32)), "head_dim"),
        (dict(q=jnp.zeros((2, 3, 64), jnp.float32)), r"q heads \(3\) must be a multiple"),
        (dict(q=jnp.zeros((2, 4, 64), jnp.float16)), "q must be f32/bf16"),
        (dict(v_pages=jnp.zeros((1, 2, 8, 8, 64), jnp.float32)), "v_pages must match"),
        (dict(k_pages=jnp.zeros((2, 8, 16, 64), jnp.float32)), r"k_pages must be \[L, KVH"),
        (dict(seq_lens=jnp.asarray([3, 20, 1], jnp.int32)), r"seq_lens must be i32\[2\]"),
        (dict(page_table=jnp.asarray([[0, 1]], jnp.int32)), r"page_table must be i32\[2, W\]"),
        (dict(page_table=jnp.asarray([[0, 1], [2, 8]], jnp.int32)), r"page_table\[1, 1\] = 8"),
        (
            dict(seq_lens=jnp.asarray([3, 33], jnp.int32)),
            r"seq_lens must lie in \[0, W \* page_size\]",
        ),
        (
            dict(
                k_pages=jnp.zeros((1, 2, 8, 16, 64), jnp.int8),
                v_pages=jnp.zeros((1, 2, 8, 16, 64), jnp.int8),
            ),
            "k_scale and v_scale must be",
        ),
        (
            dict(
                k_pages=jnp.zeros((1, 2, 8, 12, 64), jnp.float32),
                v_pages=jnp.zeros((1, 2, 8, 12, 64), jnp.float32),
            ),
            "page_size must be a power of two",
        ),
    ],
)
def test_decode_rejects_bad_input(over, match):
    with pytest.raises(ValueError, match=match):
        paged_attention(**with_kv(_args(**over)), interpret=True)


def test_decode_rejects_bad_scales_and_layer():
    k = jnp.zeros((1, 2, 8, 16, 64), jnp.int8)
    good = jnp.zeros((1, 2, 8, 16), jnp.float32)
    with pytest.raises(ValueError, match=r"k_scale must be f32\[1, 2, 8, 16\]"):
        paged_attention(**with_kv(_args(k_pages=k, v_pages=k, k_scale=good[..., :8], v_scale=good)))
    with pytest.raises(ValueError, match=r"layer 1 is outside \[0, 1\)"):
        paged_attention(**with_kv(_args(layer=1)))
