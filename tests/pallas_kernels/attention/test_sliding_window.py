"""Sliding window, soft-cap and scale through every attention path against the reference.

The decode kernel, the chunked-prefill kernel (interpret mode) and the CPU ragged path, each
compiled once per configuration and run for many windows (the window is traced: one program for
sliding and global layers): windows of one token, under / at / over a page, not aligned to pages,
equal to and beyond the sequence, global (0, -1); rows far beyond the window; a prefill chunk
straddling the window start; int8/fp8 pools; results the same whatever the page size; pages
wholly before the window never read (NaN there changes nothing); and `attention`'s dispatch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_kv_testing import naive_attention, np_seed, paged_from_dense, tolerance

from jaxserve.layers import attention as attn
from jaxserve.layers.kv_cache import KVCache
from pallas_kernels.attention.paged_kv import PagedKV
from pallas_kernels.attention.reference import decode_reference, prefill_reference
from pallas_kernels.attention.triton_decode import paged_attention
from pallas_kernels.attention.triton_prefill import paged_prefill_attention
from pallas_kernels.attention.tuning import DecodeConfig, PrefillConfig
from pallas_kernels.attention.xla import ragged_decode_attention

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

L, KVH, G, D = 2, 2, 4, 32
DT = {"f32": jnp.float32, "bf16": jnp.bfloat16}
DECODE_TILES = {
    "h200": DecodeConfig(),
    "small": DecodeConfig(block_k=16, max_splits=4, target_programs=1 << 20),
}
PREFILL_TILES = {
    "h200": PrefillConfig(),
    "small": PrefillConfig(block_rows=16, block_k=16, min_rows=8),
}
WINDOWS = (1, 5, 16, 17, 45, 200, 500, 0, -1)
OPTS = {"plain": (None, None), "cap": (1.5, None), "cap+scale": (3.0, 0.25), "scale": (None, 0.5)}


def dense(seed, b, s):
    rng = np_seed("sw-dense", seed, b, s)
    kd = rng.standard_normal((L, KVH, b, s, D)) * 1.5  # logits of a few units: caps bind
    vd = rng.standard_normal((L, KVH, b, s, D))
    return rng, kd, vd


def decode_all(tiles, softcap, scale):
    """One jitted program: (kernel, ragged, reference) decode outputs for a traced window."""

    def run(q, k, v, lens, pt, ks, vs, window):
        opts = dict(window=window, softcap=softcap, scale=scale)
        kv = PagedKV(k, v, ks, vs, 1)
        kern = paged_attention(q, kv, lens, pt, **opts, config=DECODE_TILES[tiles], interpret=True)
        rag = ragged_decode_attention(q, kv, lens, pt, lens.shape[0] * pt.shape[1], **opts)
        return kern, rag, decode_reference(q, kv, lens, pt, **opts)

    return jax.jit(run)


DECODE_CASES = [
    # (page size, KV dtype, q dtype, tiles, logit options)
    (8, "auto", "f32", "small", "cap+scale"),
    (16, "int8", "bf16", "h200", "cap"),
    (32, "fp8", "f32", "small", "scale"),
    (16, "auto", "bf16", "small", "plain"),
    (8, "int8", "f32", "h200", "cap"),
]


@pytest.mark.parametrize("ps,kv,q,tiles,opts", DECODE_CASES)
def test_decode_paths_match_reference(ps, kv, q, tiles, opts):
    lens = np.array([0, 1, 7, 16, 17, 45, 200], np.int32)
    rng, kd, vd = dense("decode", len(lens), 200)
    k, v, ks, vs, pt = paged_from_dense(rng, kd, vd, ps, kv, DT[q])
    qa = jnp.asarray(rng.standard_normal((len(lens), KVH * G, D)) * 1.5, DT[q])
    run = decode_all(tiles, *OPTS[opts])
    tol = tolerance(DT[q], kv)
    for window in WINDOWS:
        kern, rag, ref = (
            np.asarray(x.astype(jnp.float32))
            for x in run(qa, k, v, jnp.asarray(lens), pt, ks, vs, jnp.int32(window))
        )
        assert np.isfinite(kern).all() and not kern[0].any()  # inactive row: zeros
        np.testing.assert_allclose(kern, ref, atol=tol, rtol=0, err_msg=f"window {window}")
        np.testing.assert_allclose(rag, ref, atol=tol, rtol=0, err_msg=f"window {window}")


def prefill_rows(t):
    """(positions [B, T], real token counts, seq_lens) of 5 rows: a chunk from 0, a chunk
    straddling a 24-token window's start, a chunk far beyond it, a short chunk with padding, an
    inactive row."""
    starts = np.array([0, 40, 180, 93, 0])
    counts = np.array([t, t, t, 3, 0])
    lens = np.where(counts > 0, starts + counts, 0).astype(np.int32)
    pos = starts[:, None] + np.arange(t)[None, :]  # padding continues the positions, as the runner
    return jnp.asarray(pos, jnp.int32), counts, jnp.asarray(lens)


def prefill_both(tiles, softcap, scale):
    def run(q, k, v, pos, lens, pt, ks, vs, window):
        opts = dict(window=window, softcap=softcap, scale=scale)
        kv = PagedKV(k, v, ks, vs, 1)
        kern = paged_prefill_attention(
            q, kv, pos, lens, pt, **opts, config=PREFILL_TILES[tiles], interpret=True
        )
        return kern, prefill_reference(q, kv, pos, lens, pt, **opts)

    return jax.jit(run)


PREFILL_CASES = [
    (8, "auto", "f32", "small", "cap+scale"),
    (16, "fp8", "bf16", "h200", "cap"),
    (32, "int8", "f32", "small", "plain"),
    (16, "auto", "bf16", "small", "scale"),
]


@pytest.mark.parametrize("ps,kv,q,tiles,opts", PREFILL_CASES)
def test_prefill_kernel_matches_reference(ps, kv, q, tiles, opts):
    t = 20
    pos, counts, lens = prefill_rows(t)
    rng, kd, vd = dense("prefill", 5, 200)
    k, v, ks, vs, pt = paged_from_dense(rng, kd, vd, ps, kv, DT[q])
    qa = jnp.asarray(rng.standard_normal((5, t, KVH * G, D)) * 1.5, DT[q])
    run = prefill_both(tiles, *OPTS[opts])
    real = np.arange(t)[None, :] < counts[:, None]  # (B, T)
    for window in (1, 7, 16, 24, 64, 300, 0, -1):
        kern, ref = (
            np.asarray(x.astype(jnp.float32))
            for x in run(qa, k, v, pos, lens, pt, ks, vs, jnp.int32(window))
        )
        assert np.isfinite(kern).all() and not kern[-1].any()
        np.testing.assert_allclose(
            kern[real], ref[real], atol=tolerance(DT[q], kv), rtol=0, err_msg=f"window {window}"
        )


def test_the_same_whatever_the_page_size():
    """Decode and prefill of the same sequences (f32) over pools of page size 8, 16 and 32 agree
    with each other and with the loop-by-loop definition."""
    window, softcap = 13, 2.0
    lens = np.array([5, 13, 14, 60], np.int32)
    rng, kd, vd = dense("ps", 4, 60)
    q = jnp.asarray(rng.standard_normal((4, KVH * G, D)) * 1.5, jnp.float32)
    starts = np.array([0, 10, 20, 56])  # 4-token chunks, the last ending at the sequence's end
    pos = jnp.asarray(starts[:, None] + np.arange(4)[None, :], jnp.int32)
    plens = jnp.asarray(starts + 4, jnp.int32)
    qp = jnp.asarray(rng.standard_normal((4, 4, KVH * G, D)) * 1.5, jnp.float32)
    outs = []
    for ps in (8, 16, 32):
        k, v, _, _, pt = paged_from_dense(np_seed("ps-pages", ps), kd, vd, ps)
        kv = PagedKV(k, v, layer=1)
        opts = dict(window=jnp.int32(window), softcap=softcap)
        dec = paged_attention(q, kv, jnp.asarray(lens), pt, **opts, interpret=True)
        rag = ragged_decode_attention(q, kv, jnp.asarray(lens), pt, 4 * pt.shape[1], **opts)
        pre = paged_prefill_attention(qp, kv, pos, plens, pt, **opts, interpret=True)
        want_d = naive_attention(
            q[:, None], k, v, None, None, pt, lens[:, None] - 1, lens, 1, window, softcap, None
        )[:, 0]
        want_p = naive_attention(qp, k, v, None, None, pt, pos, plens, 1, window, softcap, None)
        for got, want in ((dec, want_d), (rag, want_d), (pre, want_p)):
            np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=0, err_msg=f"ps {ps}")
        outs.append([np.asarray(x) for x in (dec, rag, pre)])
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            np.testing.assert_allclose(a, b, atol=2e-5, rtol=0)


@pytest.mark.parametrize("tiles", ["h200", "small"])
def test_pages_before_the_window_are_never_read(tiles):
    """A 500-token row under a 24-token window (decode) and a 20-token chunk ending at 500
    (prefill): NaN in every page wholly before the window (the chunk's earliest window) leaves
    the result unchanged, so no such page is loaded (a loaded NaN value would poison P.V)."""
    ps, window, n = 8, 24, 500
    rng, kd, vd = dense("nan", 2, n)
    k, v, _, _, pt = paged_from_dense(rng, kd, vd, ps)
    lens = jnp.asarray([n, 9], jnp.int32)
    pos = jnp.asarray(np.stack([np.arange(n - 20, n), np.arange(20) % 9]), jnp.int32)
    dec_first = (n - window) // ps  # decode: the query at n - 1 sees keys n - 24 ..
    pre_first = (n - 20 - window + 1) // ps  # prefill: the chunk's first token sees keys 457 ..

    def poison(x, pages):
        return x.at[:, :, pt[0, :pages]].set(jnp.nan)

    q = jnp.asarray(rng.standard_normal((2, KVH * G, D)), jnp.float32)
    qp = jnp.asarray(rng.standard_normal((2, 20, KVH * G, D)), jnp.float32)
    w = jnp.int32(window)
    dec = jax.jit(
        lambda k, v: paged_attention(
            q, PagedKV(k, v, layer=1), lens, pt, window=w, config=DECODE_TILES[tiles],
            interpret=True,
        )
    )  # fmt: skip
    pre = jax.jit(
        lambda k, v: paged_prefill_attention(
            qp, PagedKV(k, v, layer=1), pos, lens, pt, window=w, config=PREFILL_TILES[tiles],
            interpret=True,
        )
    )  # fmt: skip
    clean_d, clean_p = np.asarray(dec(k, v)), np.asarray(pre(k, v))
    got_d = np.asarray(dec(poison(k, dec_first), poison(v, dec_first)))
    got_p = np.asarray(pre(poison(k, pre_first), poison(v, pre_first)))
    np.testing.assert_array_equal(got_d, clean_d)
    np.testing.assert_array_equal(got_p, clean_p)
    # ... and one page later would be read: the poisoning reaches the result.
    assert np.isnan(np.asarray(dec(poison(k, dec_first + 1), poison(v, dec_first + 1)))).any()
    ref = prefill_reference(qp, PagedKV(k, v, layer=1), pos, lens, pt, window=w)
    np.testing.assert_allclose(clean_p, np.asarray(ref), atol=2e-5, rtol=0)


@pytest.mark.parametrize("impl", ["pallas_interpret", "ragged"])
def test_attention_dispatch_passes_the_options(impl):
    """`attention` (decode and a prefill chunk) under each impl equals the reference impl, for a
    windowed soft-capped layer and a global one."""
    ps, n = 8, 64
    rng, kd, vd = dense("dispatch", 3, n)
    k, v, ks, vs, pt = paged_from_dense(rng, kd, vd, ps, "int8")
    cache = KVCache(k=k, v=v, k_scale=ks, v_scale=vs)
    lens = jnp.asarray([n, 30, 0], jnp.int32)
    dec_meta = attn.AttentionMetadata(
        positions=jnp.maximum(lens - 1, 0)[:, None],
        slot_mapping=jnp.full((3, 1), -1, jnp.int32),
        page_table=pt,
        seq_lens=lens,
        num_flat_pages=3 * pt.shape[1],
    )
    pos = jnp.asarray(np.stack([np.arange(48, 64), np.arange(14, 30), np.arange(16)]), jnp.int32)
    pre_meta = attn.AttentionMetadata(
        positions=pos, slot_mapping=jnp.full((3, 16), -1, jnp.int32), page_table=pt, seq_lens=lens
    )
    q1 = jnp.asarray(rng.standard_normal((3, 1, KVH * G, D)), jnp.float32)
    qt = jnp.asarray(rng.standard_normal((3, 16, KVH * G, D)), jnp.float32)

    @jax.jit
    def both(window):
        out = []
        for q, meta in ((q1, dec_meta), (qt, pre_meta)):
            for i in (impl, "reference"):
                out.append(
                    attn.attention(
                        q, cache, jnp.int32(1), meta, i, window=window, softcap=2.5, scale=0.3
                    )
                )
        return out

    for window in (10, 0):
        d, d_ref, p, p_ref = (np.asarray(x) for x in both(jnp.int32(window)))
        np.testing.assert_allclose(d, d_ref, atol=1e-4, rtol=0)
        np.testing.assert_allclose(p[:2], p_ref[:2], atol=1e-4, rtol=0)


def test_window_cases_are_registered_for_cuda_lowering():
    """`python -m pallas_kernels.check` lowers both kernels with a traced window (and Gemma 2's
    soft-cap) for every sliding-window model, page size, q dtype and KV dtype."""
    from pallas_kernels import check
    from pallas_kernels.attention.triton_common import WINDOW_MODEL_HEADS

    names = {c.name for c in check.CHECKS}
    for kernel in ("decode", "prefill"):
        for model, *_, softcap, _ in WINDOW_MODEL_HEADS:
            tail = "window" + ("" if softcap is None else f"/softcap{softcap:g}")
            for ps in (16, 32):
                for q in ("bfloat16", "float32"):
                    for kv in ("auto", "int8", "fp8"):
                        prefix = f"{kernel}/{model}/ps{ps}/{q}/kv-{kv}/"
                        assert any(n.startswith(prefix) and n.endswith(tail) for n in names)
    [case] = [
        c
        for c in check.CHECKS
        if c.name == "decode/gemma2-9b/ps16/bfloat16/kv-int8/window/softcap50"
    ]
    assert "tanh" in check.lower_for_h200(case)


@pytest.mark.parametrize(
    "over, match",
    [
        (dict(window=jnp.zeros((2,), jnp.int32)), "window must be an integer scalar"),
        (dict(window=1.5), "window must be an integer scalar"),
        (dict(softcap=0.0), "softcap must be a positive"),
        (dict(scale=-1.0), "scale must be a positive"),
        (dict(softcap=jnp.float32(2.0)), "softcap must be a positive Python float"),
    ],
)
def test_kernels_reject_bad_options(over, match):
    q = jnp.zeros((2, 4, 64), jnp.float32)
    k = jnp.zeros((1, 2, 8, 16, 64), jnp.float32)
    lens = jnp.asarray([3, 20], jnp.int32)
    pt = jnp.asarray([[0, 1], [2, 3]], jnp.int32)
    with pytest.raises(ValueError, match=match):
        paged_attention(q, PagedKV(k, k), lens, pt, **over, interpret=True)
    with pytest.raises(ValueError, match=match):
        paged_prefill_attention(
            q[:, None], PagedKV(k, k), jnp.zeros((2, 1), jnp.int32), lens, pt, **over,
            interpret=True,
        )  # fmt: skip


@pytest.mark.parametrize("tiles", ["h200", "small"])
def test_prefill_is_the_same_whatever_the_chunking(tiles):
    """One 48-token sequence under a 10-token window: prefilled as one chunk, or as chunks of 16 +
    32 and 20 + 20 + 8 (rows of one call over the same pages), each token's output agrees."""
    ps, n, window = 8, 48, 10
    rng, kd, vd = dense("chunks", 1, n)
    k, v, _, _, pt = paged_from_dense(rng, kd, vd, ps)
    qs = jnp.asarray(rng.standard_normal((n, KVH * G, D)), jnp.float32)
    run = jax.jit(
        lambda q, pos, lens, pt: paged_prefill_attention(
            q, PagedKV(k, v, layer=1), pos, lens, pt, window=jnp.int32(window), softcap=2.0,
            config=PREFILL_TILES[tiles], interpret=True,
        )
    )  # fmt: skip
    whole = np.asarray(run(qs[None], jnp.arange(n, dtype=jnp.int32)[None], jnp.asarray([n]), pt))
    for cuts in ((0, 16, 48), (0, 20, 40, 48)):
        t = max(b - a for a, b in zip(cuts, cuts[1:]))
        starts, ends = np.array(cuts[:-1]), np.array(cuts[1:])
        pos = np.minimum(starts[:, None] + np.arange(t)[None, :], n - 1)  # (R, T)
        got = np.asarray(
            run(qs[pos], jnp.asarray(pos, jnp.int32), jnp.asarray(ends, jnp.int32),
                jnp.repeat(pt, len(starts), axis=0))
        )  # fmt: skip
        for r, (a, b) in enumerate(zip(starts, ends)):
            np.testing.assert_allclose(got[r, : b - a], whole[0, a:b], atol=2e-5, rtol=0)
