"""The ragged decode attention and the CPU prefill attention equal the paged reference, whatever the
lengths and page layout."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.resolve import bucket_for, pow2_buckets
from pallas_kernels.attention.paged_kv import PagedKV
from pallas_kernels.attention.reference import decode_reference, prefill_reference
from pallas_kernels.attention.xla import prefill_attention, ragged_decode_attention

L, KVH, G, D, PS, P = 2, 2, 3, 16, 4, 64
ragged = jax.jit(ragged_decode_attention, static_argnums=4, static_argnames=("softcap", "scale"))
reference = jax.jit(decode_reference, static_argnames=("softcap", "scale"))


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
    return q, PagedKV(k, v, ks, vs), jnp.asarray(kv_lens, jnp.int32), pt


def at(kv: PagedKV, layer: int) -> PagedKV:
    return kv._replace(layer=jnp.int32(layer))


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
    q, kv, lens, pt = case(kv_lens, w, quantized=quantized)
    total = int(sum(-(-n // PS) for n in kv_lens))
    tight = bucket_for(total, pow2_buckets(len(kv_lens) * w, start=8))  # as Resolved.decode_shape
    for f in {tight, len(kv_lens) * w}:  # tight and roomy buckets
        for layer in (0, 1):
            got = ragged(q, at(kv, layer), lens, pt, f)
            want = reference(q, at(kv, layer), lens, pt)
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    if not any(kv_lens):
        assert not np.asarray(got).any()


def test_row_result_does_not_depend_on_other_rows():
    """Batch invariance: a row's output is bitwise the same alone or among others, in any place."""
    q, kv, lens, pt = case([13, 7, 30, 2], 8, seed=3)
    full = np.asarray(ragged(q, kv, lens, pt, 32))
    for i in range(4):
        alone = np.asarray(ragged(q[i : i + 1], kv, lens[i : i + 1], pt[i : i + 1], 32))
        np.testing.assert_array_equal(alone[0], full[i])


OPTS = dict(softcap=2.0, scale=0.4)


def window_pages(kv_lens, window, ps=PS):
    """Flat pages a windowed step needs: each row's pages from its window's first page on."""
    first = [max(n - window, 0) // ps if window > 0 else 0 for n in kv_lens]
    return sum(-(-n // ps) - a for n, a in zip(kv_lens, first))


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("window", [1, 3, 4, 9, 31, 32, 100, 0, -2])
def test_window_softcap_scale_match_reference(window, quantized):
    """Windows of one token, under / at / over a page, equal to and beyond the longest row,
    global; a binding cap (2.0) and a custom scale; F as tight as the windows allow."""
    kv_lens = [5, 0, 16, 1, 9, 32, 30]
    q, kv, lens, pt = case(kv_lens, 8, seed=4, quantized=quantized)
    q = q * 3  # logits of several units: the cap binds
    want = reference(q, at(kv, 1), lens, pt, window=jnp.int32(window), **OPTS)
    for f in (window_pages(kv_lens, window), len(kv_lens) * 8):
        got = ragged(q, at(kv, 1), lens, pt, f, window=jnp.int32(window), **OPTS)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


def test_far_beyond_the_window_reads_only_the_window():
    """A 120-token row with a 10-token window: 3 flat pages suffice, whatever sits before them."""
    q, kv, lens, pt = case([120, 7], 30, seed=5)
    f = window_pages([120, 7], 10)
    assert f == 3 + 2
    want = reference(q, at(kv, 0), lens, pt, window=jnp.int32(10), **OPTS)
    got = ragged(q, at(kv, 0), lens, pt, f, window=jnp.int32(10), **OPTS)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    # NaN in the pages before row 0's window (its first 27 pages) changes nothing: never read
    # (a masked but gathered NaN value would still poison P.V).
    k2 = kv.k_pages.at[0, :, pt[0, :27]].set(jnp.nan)
    v2 = kv.v_pages.at[0, :, pt[0, :27]].set(jnp.nan)
    got2 = ragged(q, at(PagedKV(k2, v2), 0), lens, pt, f, window=jnp.int32(10), **OPTS)
    np.testing.assert_array_equal(np.asarray(got2), np.asarray(got))


def test_window_at_most_zero_is_global_bit_for_bit():
    q, kv, lens, pt = case([13, 7, 30, 2], 8, seed=3)
    plain = np.asarray(ragged(q, kv, lens, pt, 32))
    for w in (0, -1):
        same = ragged(q, kv, lens, pt, 32, window=jnp.int32(w))
        np.testing.assert_array_equal(np.asarray(same), plain)


prefill = jax.jit(prefill_attention, static_argnames=("softcap", "scale"))
reference_prefill = jax.jit(prefill_reference, static_argnames=("softcap", "scale"))


def prefill_case(starts, lengths, t, w, seed=0, quantized=False):
    """Chunks of t query tokens: row b's tokens start at starts[b], lengths[b] of them are real
    (the rest padding, as the engine pads a chunk); seq_len = start + length, 0 for an empty row."""
    q1, kv, _, pt = case([0] * len(starts), w, seed=seed, quantized=quantized)
    rng = np.random.default_rng(seed + 100)
    q = jnp.asarray(rng.normal(size=(len(starts), t, KVH * G, D)), jnp.float32)
    pos = jnp.asarray(np.asarray(starts)[:, None] + np.arange(t)[None, :], jnp.int32)
    lens = jnp.asarray([s + n if n else 0 for s, n in zip(starts, lengths)], jnp.int32)
    return q, kv, pos, lens, pt


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize(
    "starts,lengths,t,w",
    [
        ([0, 5, 12, 0], [6, 6, 3, 0], 6, 5),  # from the start, mid-sequence, padded, empty row
        ([0], [1], 1, 2),  # one token (T = 1 also works)
        ([20, 0, 3], [8, 8, 8], 8, 8),  # a row near the page-table end
    ],
)
def test_prefill_matches_reference(starts, lengths, t, w, quantized):
    q, kv, pos, lens, pt = prefill_case(starts, lengths, t, w, quantized=quantized)
    for layer in (0, 1):
        got = prefill(q, at(kv, layer), pos, lens, pt)
        want = reference_prefill(q, at(kv, layer), pos, lens, pt)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    if not lengths[-1]:
        assert not np.asarray(got)[-1].any()  # an empty row gets zeros


@pytest.mark.parametrize("window", [1, 4, 9, 0, -2])
def test_prefill_window_softcap_scale_match_reference(window):
    q, kv, pos, lens, pt = prefill_case([0, 5, 17, 2], [8, 8, 8, 5], 8, 8, seed=6)
    opts = dict(window=jnp.int32(window), **OPTS)
    got = prefill(q * 3, at(kv, 1), pos, lens, pt, **opts)
    want = reference_prefill(q * 3, at(kv, 1), pos, lens, pt, **opts)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


def test_prefill_row_result_does_not_depend_on_other_rows():
    """Batch invariance within one compiled shape (the engine's prefill programs have fixed rows),
    bitwise: a chunk's output is the same whatever the other rows hold, an empty row included."""
    q, kv, pos, lens, pt = prefill_case([0, 9, 3, 14], [8, 8, 4, 8], 8, 8, seed=7)
    q2, _, pos2, lens2, pt2 = prefill_case([5, 0, 1, 2], [3, 0, 8, 6], 8, 8, seed=8)
    full = np.asarray(prefill(q, kv, pos, lens, pt))
    for i in range(4):
        mix = [b.at[i].set(a[i]) for a, b in ((q, q2), (pos, pos2), (lens, lens2), (pt, pt2))]
        got = np.asarray(prefill(mix[0], kv, mix[1], mix[2], mix[3]))
        np.testing.assert_array_equal(got[i], full[i])


def test_prefill_result_does_not_depend_on_the_page_table_width():
    """Bitwise: a chunk's output is the same in a step whose page table is wider (another row's
    longer sequence, or a prefix-cache hit's narrower step), and at any row count. One dot over
    all W * ps keys summed in an order XLA picks by W, and differed (bf16 outputs, 5 in 5 draws)."""
    for seed in range(4):
        q, kv, pos, lens, pt = prefill_case([0, 9], [8, 8], 8, 8, seed=seed)
        q, kv = q.astype(jnp.bfloat16), at(kv, 1)
        wide = np.asarray(prefill(q, kv, pos, lens, pt).astype(jnp.float32))
        for w in (5, 6, 7):  # row 1 holds 17 tokens: 5 pages of PS = 4
            got = np.asarray(prefill(q, kv, pos, lens, pt[:, :w]).astype(jnp.float32))
            np.testing.assert_array_equal(got, wide)
        one = prefill(q[1:], kv, pos[1:], lens[1:], pt[1:, :5]).astype(jnp.float32)
        np.testing.assert_array_equal(np.asarray(one)[0], wide[1])
