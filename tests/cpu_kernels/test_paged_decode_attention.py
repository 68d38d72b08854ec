"""The C++ CPU paged attention equals its jnp references (the attention family's `decode_reference`
at one query per row, and its `prefill_reference` with zeros at padding tokens over prefill chunks),
for every pool dtype, page size, head layout, length, window, soft-cap and scale; a prefill token's
result is a decode row's, whatever its chunk and width."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import paged_decode_attention as pda
from pallas_kernels.attention.paged_kv import PagedKV
from pallas_kernels.attention.reference import decode_reference

kernel = jax.jit(pda.paged_decode_attention, static_argnames=("softcap", "scale"))
reference = jax.jit(decode_reference, static_argnames=("softcap", "scale"))
prefill = jax.jit(pda.paged_prefill_attention, static_argnames=("softcap", "scale"))
prefill_reference = jax.jit(
    pda.paged_prefill_attention_reference, static_argnames=("softcap", "scale")
)


def test_builds_here():
    assert pda.available(), pda.build_error()


def case(kv_lens, w, *, kvh=2, g=3, d=64, ps=8, pool="float32", q_dtype="float32", seed=0):
    rng = np.random.default_rng(seed)
    b, num_pages, layers = len(kv_lens), max(64, len(kv_lens) * w + 3), 2
    shape = (layers, kvh, num_pages, ps, d)
    ks = vs = None
    if pool == "int8":
        k = jnp.asarray(rng.integers(-127, 128, shape), jnp.int8)
        v = jnp.asarray(rng.integers(-127, 128, shape), jnp.int8)
    elif pool == "fp8":
        k = jnp.asarray(rng.normal(size=shape) * 40, jnp.float32).astype(jnp.float8_e4m3fn)
        v = jnp.asarray(rng.normal(size=shape) * 40, jnp.float32).astype(jnp.float8_e4m3fn)
    else:
        k = jnp.asarray(rng.normal(size=shape), pool)
        v = jnp.asarray(rng.normal(size=shape), pool)
    if pool in ("int8", "fp8"):
        ks = jnp.asarray(rng.uniform(0.001, 0.02, shape[:-1]), jnp.float32)
        vs = jnp.asarray(rng.uniform(0.001, 0.02, shape[:-1]), jnp.float32)
    pt = rng.permutation(num_pages)[: b * w].reshape(b, w)  # pages in any order
    q = jnp.asarray(rng.normal(size=(b, kvh * g, d)), q_dtype)
    return q, PagedKV(k, v, ks, vs), jnp.asarray(kv_lens, jnp.int32), jnp.asarray(pt, jnp.int32)


def at(kv: PagedKV, layer) -> PagedKV:
    return kv._replace(layer=layer)


def close(got, want, dtype):
    tol = 2e-5 if jnp.dtype(dtype) == jnp.float32 else 1e-2
    assert got.dtype == want.dtype
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol
    )


@pytest.mark.parametrize("pool", ["float32", "bfloat16", "float16", "int8", "fp8"])
@pytest.mark.parametrize("q_dtype", ["float32", "bfloat16"])
def test_pool_and_query_dtypes(pool, q_dtype):
    q, kv, lens, pt = case([5, 0, 32, 1, 9, 17], 4, pool=pool, q_dtype=q_dtype)
    for layer in (0, 1):
        got = kernel(q, at(kv, jnp.int32(layer)), lens, pt)
        close(got, reference(q, at(kv, layer), lens, pt), q_dtype)
    assert not np.asarray(got[1], np.float32).any()  # kv_len 0: zeros


@pytest.mark.parametrize(
    "kvh,g,d,ps",
    [(1, 1, 16, 4), (2, 4, 128, 16), (3, 3, 64, 8), (1, 8, 80, 32), (4, 2, 256, 8), (2, 2, 20, 1)],
)
def test_head_layouts_and_page_sizes(kvh, g, d, ps):
    """GQA groups, MHA, head dims not a multiple of the kernel's 16 lanes, pages of 1-32."""
    w = -(-70 // ps)
    q, kv, lens, pt = case([70, 3, ps, ps + 1, 0, 41], w, kvh=kvh, g=g, d=d, ps=ps, seed=1)
    close(kernel(q, at(kv, 1), lens, pt), reference(q, at(kv, 1), lens, pt), "float32")


def test_windows_softcap_and_scale():
    q, kv, lens, pt = case([40, 7, 1, 0, 24, 33], 5, seed=2)
    for window in (None, 0, -1, 1, 5, 8, 9, 16, 64):
        for softcap, scale in ((None, None), (20.0, None), (None, 0.3), (5.0, 1.7)):
            win = None if window is None else jnp.int32(window)  # traced, as the model's
            got = kernel(q, kv, lens, pt, window=win, softcap=softcap, scale=scale)
            want = reference(q, kv, lens, pt, window=win, softcap=softcap, scale=scale)
            close(got, want, "float32")


def test_lengths_beyond_the_page_table_are_clipped():
    """A kv_len past W * ps reads the row's W pages only (as the ragged path and the reference)."""
    q, kv, lens, pt = case([100, 16], 2, seed=4)
    close(kernel(q, kv, lens, pt), reference(q, kv, lens, pt), "float32")


def test_row_result_does_not_depend_on_other_rows():
    """Batch invariance: a row's output is bitwise the same alone or among others, in any place."""
    q, kv, lens, pt = case([13, 7, 30, 2, 25], 4, pool="bfloat16", q_dtype="bfloat16")
    full = np.asarray(kernel(q, kv, lens, pt), np.float32)
    for i in range(len(lens)):
        alone = kernel(q[i : i + 1], kv, lens[i : i + 1], pt[i : i + 1])
        np.testing.assert_array_equal(np.asarray(alone, np.float32)[0], full[i])
    perm = np.array([3, 0, 4, 2, 1])
    shuffled = np.asarray(kernel(q[perm], kv, lens[perm], pt[perm]), np.float32)
    np.testing.assert_array_equal(shuffled, full[perm])


def test_inside_a_layer_scan_with_a_traced_layer():
    """As the model calls it: under `lax.scan` over layers, the pool passed whole."""
    q, kv, lens, pt = case([9, 30, 4], 4, seed=6)

    @jax.jit
    def both(q):
        def body(carry, layer):
            return carry, (
                pda.paged_decode_attention(q, at(kv, layer), lens, pt),
                decode_reference(q, at(kv, layer), lens, pt),
            )

        return jax.lax.scan(body, 0, jnp.arange(2))[1]

    got, want = both(q)
    close(got, want, "float32")


def test_bad_shapes_are_errors():
    q, kv, lens, pt = case([3], 1, pool="int8")
    with pytest.raises(ValueError, match="do not fit"):
        pda.paged_decode_attention(q[:, :, :32], kv, lens, pt)
    with pytest.raises(ValueError, match="both k_scale and v_scale"):
        pda.paged_decode_attention(q, kv._replace(v_scale=None), lens, pt)


def chunks(starts, lengths, t, w, *, pool="float32", q_dtype="float32", ps=8, seed=0):
    """Prefill chunks: row b holds tokens [start_b, start_b + length_b) of its sequence, padded to
    t (length 0: a padding row); the pools and tables of `case`."""
    q, kv, _, pt = case([0] * len(starts), w, pool=pool, q_dtype=q_dtype, ps=ps, seed=seed)
    rng = np.random.default_rng(seed + 100)
    qc = jnp.asarray(rng.normal(size=(len(starts), t, q.shape[1], q.shape[2])), q_dtype)
    starts, lengths = np.asarray(starts), np.asarray(lengths)
    pos = jnp.asarray(starts[:, None] + np.arange(t)[None, :], jnp.int32)
    lens = jnp.asarray(np.where(lengths > 0, starts + lengths, 0), jnp.int32)
    return qc, kv, pos, lens, pt


@pytest.mark.parametrize("pool", ["float32", "bfloat16", "int8", "fp8"])
def test_prefill_chunks_equal_the_reference(pool):
    """Chunks at the start of a sequence and in its middle, partly padded, and a padding row
    (zeros at padding tokens); every window, soft-cap and scale."""
    q_dtype = "float32" if pool == "float32" else "bfloat16"
    q, kv, pos, lens, pt = chunks(
        [0, 21, 5, 0, 40], [12, 9, 1, 0, 16], 16, 8, pool=pool, q_dtype=q_dtype
    )
    for window in (None, 1, 6, 17):
        for softcap, scale in ((None, None), (5.0, 0.3)):
            win = None if window is None else jnp.int32(window)
            opts = dict(window=win, softcap=softcap, scale=scale)
            got = prefill(q, at(kv, jnp.int32(1)), pos, lens, pt, **opts)
            close(got, prefill_reference(q, at(kv, 1), pos, lens, pt, **opts), q_dtype)
    assert not np.asarray(got[3], np.float32).any()  # a padding row
    assert not np.asarray(got[0, 12:], np.float32).any()  # padding tokens


def test_prefill_token_does_not_depend_on_its_chunk_rows_or_width():
    """Bitwise: a prefill token's result is the same whether its chunk is split (a prefix-cache
    hit, a chunked prompt), its row sits among others, or the page table is wider; across a key
    tile boundary (128) too."""
    q, kv, pos, lens, pt = chunks([0, 7, 120], [24, 17, 20], 24, 18, pool="bfloat16",
                                  q_dtype="bfloat16", seed=3)  # fmt: skip
    full = np.asarray(prefill(q, kv, pos, lens, pt), np.float32)
    for b in range(3):
        alone = prefill(q[b : b + 1], kv, pos[b : b + 1], lens[b : b + 1], pt[b : b + 1])
        np.testing.assert_array_equal(np.asarray(alone, np.float32)[0], full[b])
        for cut in (1, 10, 17):  # the first `cut` tokens, then the rest as a second chunk
            first = prefill(q[b : b + 1, :cut], kv, pos[b : b + 1, :cut],
                            pos[b : b + 1, cut - 1] + 1, pt[b : b + 1])  # fmt: skip
            rest = prefill(q[b : b + 1, cut:], kv, pos[b : b + 1, cut:], lens[b : b + 1],
                           pt[b : b + 1])  # fmt: skip
            both = np.concatenate([np.asarray(first, np.float32), np.asarray(rest, np.float32)], 1)
            np.testing.assert_array_equal(both[0], full[b])
    wide = jnp.concatenate([pt, jnp.zeros((3, 12), jnp.int32)], axis=1)
    np.testing.assert_array_equal(np.asarray(prefill(q, kv, pos, lens, wide), np.float32), full)


def test_prefill_single_tokens_equal_the_decode_kernel():
    """A chunk of one token per row is a decode step: both handlers agree with the reference."""
    q, kv, pos, lens, pt = chunks([4, 0, 30], [1, 1, 1], 1, 5, pool="int8", seed=5)
    got = prefill(q, at(kv, 1), pos, lens, pt)
    close(got[:, 0], kernel(q[:, 0], at(kv, 1), pos[:, 0] + 1, pt), "float32")


def test_prefill_bad_shapes_are_errors():
    q, kv, pos, lens, pt = chunks([0, 4], [3, 2], 4, 2)
    with pytest.raises(ValueError, match="do not fit"):
        pda.paged_prefill_attention(q, kv, pos[:, :3], lens, pt)
    with pytest.raises(ValueError, match="do not fit"):
        pda.paged_prefill_attention(q, kv, pos, lens, pt[:1])
    with pytest.raises(ValueError, match="does not fit"):
        pda.paged_decode_attention(q[:, 0], kv, lens, pt[:1])
