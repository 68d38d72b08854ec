"""Ragged chunked-prefill kernel (interpret mode) against the reference, plus its input checks.

Pairwise cover of q dtype x KV dtype x page size x head_dim x GQA group x tiling (12 cases). Each
case is one ragged batch of rows whose chunks start at offset 0, 1, mid-page, end exactly at the
maximum length, carry padding tokens, or are inactive (seq_len 0), over a permuted page table.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_kv_testing import make_pool, np_seed, pairwise_covered, permuted_page_table, tolerance

from pallas_kernels.attention.paged_kv import PagedKV
from pallas_kernels.attention.reference import prefill_reference
from pallas_kernels.attention.triton_prefill import paged_prefill_attention
from pallas_kernels.attention.tuning import PrefillConfig

# jax warns on every Triton-backend pallas_call (upstream deprecation).
pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


DT = {"f32": jnp.float32, "bf16": jnp.bfloat16}
# "small" tiles: several query blocks per row and several key tiles per program.
TILES = {"h200": PrefillConfig(), "small": PrefillConfig(block_rows=16, block_k=8, min_rows=8)}
NAMES = ("q", "kv", "ps", "d", "group", "tiles")
CASES = [
    ("bf16", "auto", 16, 64, 1, "h200"),
    ("bf16", "auto", 32, 128, 4, "small"),
    ("bf16", "auto", 8, 128, 3, "small"),
    ("bf16", "fp8", 32, 64, 3, "h200"),
    ("bf16", "fp8", 8, 64, 8, "h200"),
    ("bf16", "int8", 32, 128, 8, "small"),
    ("bf16", "int8", 8, 64, 4, "h200"),
    ("f32", "auto", 16, 64, 8, "small"),
    ("f32", "fp8", 16, 128, 4, "small"),
    ("f32", "fp8", 8, 128, 1, "small"),
    ("f32", "int8", 16, 128, 3, "h200"),
    ("f32", "int8", 32, 64, 1, "small"),
]
KVH, LAYERS, WIDTH = 2, 2, 4


def test_cases_cover_every_pair():
    assert pairwise_covered(CASES, NAMES) == []


def ragged_rows(ps: int, t: int):
    """(starts, real token counts, seq_lens) of 5 rows: offsets 0, 1, mid-page, ending at the
    maximum, and an inactive row."""
    starts = np.array([0, 1, ps + ps // 2, WIDTH * ps - 5, 0])
    counts = np.array([t, t - 2, t, 5, 0])
    lens = np.where(counts > 0, starts + counts, 0).astype(np.int32)
    return starts, counts, lens


@pytest.mark.parametrize(NAMES, CASES)
def test_prefill_matches_reference(q, kv, ps, d, group, tiles):
    rng = np_seed("prefill", q, kv, ps, d, group, tiles)
    dtype = DT[q]
    t = ps + 3  # crosses a page boundary
    starts, counts, lens = ragged_rows(ps, t)
    b, h = len(lens), KVH * group
    pages = b * WIDTH + 2
    k, v, ks, vs = make_pool(rng, LAYERS, KVH, pages, ps, d, kv, dtype)
    pt = permuted_page_table(rng, b, WIDTH, pages)
    qa = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32).astype(dtype)
    positions = jnp.asarray(starts[:, None] + np.arange(t)[None, :], jnp.int32)
    seq_lens = jnp.asarray(lens)

    # One jit for kernel and reference: one compile per case (interpret mode compiles slowly).
    both = jax.jit(
        lambda *a: (
            paged_prefill_attention(*a, config=TILES[tiles], interpret=True),
            prefill_reference(*a),
        )
    )
    out, ref = both(qa, PagedKV(k, v, ks, vs, jnp.int32(1)), positions, seq_lens, pt)

    assert out.shape == (b, t, h, d) and out.dtype == dtype
    out32 = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out32).all()  # padding tokens: any finite value
    assert (out32[-1] == 0).all()  # inactive row
    real = np.arange(t)[None, :] < counts[:, None]  # (B, T)
    np.testing.assert_allclose(
        out32[real], np.asarray(ref.astype(jnp.float32))[real], atol=tolerance(dtype, kv), rtol=0
    )


def test_prefill_rejects_bad_input():
    q = jnp.zeros((2, 4, 4, 64), jnp.float32)
    k = jnp.zeros((1, 2, 8, 16, 64), jnp.float32)
    lens = jnp.asarray([3, 20], jnp.int32)
    pt = jnp.asarray([[0, 1], [2, 3]], jnp.int32)
    pos = jnp.zeros((2, 4), jnp.int32)
    kv = PagedKV(k, k)
    with pytest.raises(ValueError, match=r"positions must be i32\[2, 4\]"):
        paged_prefill_attention(q, kv, pos[:, :3], lens, pt)
    with pytest.raises(ValueError, match=r"q must be f32/bf16 \[B, T, H, D\]"):
        paged_prefill_attention(q[0], kv, pos, lens, pt)
    with pytest.raises(ValueError, match=r"page_table\[0, 0\] = -1 points past the pool"):
        paged_prefill_attention(q, kv, pos, lens, pt.at[0, 0].set(-1))
    with pytest.raises(ValueError, match=r"q heads \(4\) must be a multiple of the KV heads"):
        k3 = k[:, :1].repeat(3, 1)
        paged_prefill_attention(q, PagedKV(k3, k3), pos, lens, pt)
