"""The reference's sliding window, soft-cap and scale against a loop-by-loop numpy definition.

`prefill_reference` defines every path (the kernels, the XLA forms and the CPU kernels are tested
against it and `decode_reference`, itself at T = 1), so here it is checked against
`naive_attention`: windows smaller than, equal to and
larger than the sequence and not aligned to pages, a binding soft-cap, a custom scale, quantized
pools; results the same whatever the page size; window <= 0 bit-for-bit global attention.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_kv_testing import naive_attention, np_seed, paged_from_dense

from pallas_kernels.attention.paged_kv import PagedKV
from pallas_kernels.attention.reference import prefill_reference

L, KVH, G, D = 2, 2, 2, 16
reference = jax.jit(prefill_reference, static_argnames=("softcap", "scale"))


def rows(s):
    """(positions [B, T], seq_lens [B]) of 4 rows of T = 6 tokens over sequences of up to s: a
    chunk from 0, a chunk ending at s, a decode-like tail with padding, an inactive row."""
    t = 6
    pos = np.stack([np.arange(t), np.arange(s - t, s), np.arange(s - 3, s + 3), np.zeros(t)])
    lens = np.array([t, s, s, 0])
    return jnp.asarray(pos, jnp.int32), jnp.asarray(lens, jnp.int32)


def setup(s, ps, kv="auto", seed=0):
    rng = np_seed("options", s, seed)
    kd = rng.standard_normal((L, KVH, 4, s, D)) * 2  # logits of a few units: soft-caps bind
    vd = rng.standard_normal((L, KVH, 4, s, D))
    q = jnp.asarray(rng.standard_normal((4, 6, KVH * G, D)) * 2, jnp.float32)
    k, v, ks, vs, pt = paged_from_dense(np_seed("pages", ps), kd, vd, ps, kv)
    return q, k, v, ks, vs, pt


@pytest.mark.parametrize("kv", ["auto", "int8"])
@pytest.mark.parametrize(
    "window,softcap,scale",
    [
        (0, None, None),
        (1, None, None),  # only the query's own key
        (5, None, None),  # not aligned to pages, smaller than the chunk
        (16, 2.0, None),  # one page at ps 16, soft-cap binding
        (37, None, 0.05),  # equal to the sequence, custom scale
        (100, 1.0, 0.3),  # larger than the sequence
        (-1, 3.0, None),  # global with a cap
    ],
)
def test_reference_matches_naive(window, softcap, scale, kv):
    s = 37
    q, k, v, ks, vs, pt = setup(s, 8, kv)
    pos, lens = rows(s)
    pool = PagedKV(k, v, ks, vs, 1)
    got = reference(q, pool, pos, lens, pt, window=jnp.int32(window), softcap=softcap, scale=scale)
    want = naive_attention(q, k, v, ks, vs, pt, pos, lens, 1, window, softcap, scale)
    valid = np.asarray(pos) < np.asarray(lens)[:, None]  # (B, T): padding tokens see nothing real
    np.testing.assert_allclose(np.asarray(got)[valid], want[valid], atol=2e-5, rtol=1e-5)
    assert not np.asarray(got)[3].any()  # inactive row


@pytest.mark.parametrize("window", [3, 11, 0])
def test_reference_is_the_same_whatever_the_page_size(window):
    s = 45
    pos, lens = rows(s)
    outs = []
    for ps in (4, 8, 16, 32):
        q, k, v, ks, vs, pt = setup(s, ps)
        kv = PagedKV(k, v, layer=0)
        outs.append(
            np.asarray(reference(q, kv, pos, lens, pt, window=jnp.int32(window), softcap=5.0))
        )
    for o in outs[1:]:
        np.testing.assert_allclose(o, outs[0], atol=1e-6, rtol=1e-6)


def test_window_at_most_zero_is_global_bit_for_bit():
    s = 30
    q, k, v, ks, vs, pt = setup(s, 8)
    pos, lens = rows(s)
    kv = PagedKV(k, v, layer=1)
    plain = np.asarray(reference(q, kv, pos, lens, pt))
    for w in (0, -5):
        same = np.asarray(reference(q, kv, pos, lens, pt, window=jnp.int32(w)))
        np.testing.assert_array_equal(same, plain)
