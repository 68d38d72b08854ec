"""The ragged decode attention equals the paged reference, whatever the lengths and page layout."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.layers.ragged_attention import ragged_decode_attention
from jaxserve.resolve import bucket_for, pow2_buckets
from pallas_kernels.paged_attention import paged_attention_reference

L, KVH, G, D, PS, P = 2, 2, 3, 16, 4, 64
ragged = jax.jit(ragged_decode_attention, static_argnums=5)


def case(kv_lens, w, seed=0, quantized=False):
    rng = np.random.default_rng(seed)
    b = len(kv_lens)
    shape = (L, KVH, P, PS, D)
    if quantized:
        k = jnp.asarray(rng.integers(-127, 128, shape), jnp.int8)
        v = jnp.asarray(rng.integers(-127, 128, shape), jnp.int8)
        ks = jnp.asarray(rng.uniform(0.001, 0.02, shape[:-1]), jnp.float32)
        vs = jnp.asarray(rng.uniform(0.001, 0.02, shape[:-1]), jnp.float32)
    else:
        k = jnp.asarray(rng.normal(size=shape), jnp.float32)
        v = jnp.asarray(rng.normal(size=shape), jnp.float32)
        ks = vs = None
    pt = jnp.asarray(rng.permutation(P)[: b * w].reshape(b, w), jnp.int32)  # pages in any order
    q = jnp.asarray(rng.normal(size=(b, KVH * G, D)), jnp.float32)
    return q, k, v, jnp.asarray(kv_lens, jnp.int32), pt, ks, vs


@jax.jit
def reference(q, k, v, kv_lens, pt, layer, ks, vs):
    pos = jnp.maximum(kv_lens - 1, 0)[:, None]
    return paged_attention_reference(q[:, None], k, v, pos, kv_lens, pt, layer, ks, vs)[:, 0]


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize(
    "kv_lens,w",
    [
        ([5, 0, 16, 1, 9], 4),  # an inactive row, a full row, one-token and mid-page rows
        ([0, 0, 0], 2),  # nothing live: zeros
        ([32, 31, 2, 17, 8, 8, 1, 30], 8),
    ],
)
def test_matches_reference(kv_lens, w, quantized):
    q, k, v, lens, pt, ks, vs = case(kv_lens, w, quantized=quantized)
    total = int(sum(-(-n // PS) for n in kv_lens))
    tight = bucket_for(total, pow2_buckets(len(kv_lens) * w, start=8))  # as Resolved.decode_shape
    for f in {tight, len(kv_lens) * w}:  # tight and roomy buckets
        for layer in (0, 1):
            got = ragged(q, k, v, lens, pt, f, jnp.int32(layer), ks, vs)
            want = reference(q, k, v, lens, pt, layer, ks, vs)
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    if not any(kv_lens):
        assert not np.asarray(got).any()


def test_row_result_does_not_depend_on_other_rows():
    """Batch invariance: a row's output is bitwise the same alone or among others, in any place."""
    q, k, v, lens, pt, _, _ = case([13, 7, 30, 2], 8, seed=3)
    fn = ragged
    full = np.asarray(fn(q, k, v, lens, pt, 32))
    for i in range(4):
        alone = np.asarray(fn(q[i : i + 1], k, v, lens[i : i + 1], pt[i : i + 1], 32))
        np.testing.assert_array_equal(alone[0], full[i])
