"""Mosaic GPU prefill kernel (`pallas_kernels.attention.mgpu_prefill`): Mosaic GPU interpret mode on
the CPU against `prefill_reference`, its per-tile plan against brute force, its refusals, and a
deviceless compile for an H100 at the Llama-3-8B prefill shape.

Every interpret case is one ragged batch over a randomly permuted page table, reading layer 1 of a
two-layer pool with two KV heads: rows of length 0 (inactive), 1, ps - 1, ps + 1, a chunk starting
mid-page, and the maximum (the whole page table) with a 5-token chunk and padding tokens (position
-1). Each chunk is the last tokens of its row (their K/V already in the pages), so most start
mid-sequence. Rows are long enough for several key tiles per program (the ring refills a slot),
with tiles below every row's diagonal (unmasked) and on it (masked). Padding tokens' outputs are
only checked finite.
"""

from __future__ import annotations

import glob
import re

import pytest

from jaxserve.bench import deviceless

deviceless.prepare()  # before jax starts its backends (the CUDA plugin needs no driver then)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from paged_kv_testing import (  # noqa: E402
    make_pool,
    np_seed,
    permuted_page_table,
    tolerance,
    with_kv,
)

from pallas_kernels.attention.mgpu_prefill import _tile_plan, paged_prefill_mgpu  # noqa: E402
from pallas_kernels.attention.paged_kv import PagedKV  # noqa: E402
from pallas_kernels.attention.reference import prefill_reference  # noqa: E402
from pallas_kernels.attention.tuning import MgpuPrefillConfig  # noqa: E402

KVH, LAYERS, T = 2, 2, 19  # T: chunk tokens per row (19 crosses pages, and 64-row tiles at G >= 4)
DEFAULT = MgpuPrefillConfig()  # 64 keys a tile, 2 ring slots
DEEP = MgpuPrefillConfig(num_buffers=3)
WIDE = MgpuPrefillConfig(block_k=128)


def _case(name, kv, ps, d, group, width):
    """(q, k, v, positions, seq_lens, page_table, k_scale, v_scale, real tokens bool[B, T])."""
    rng = np_seed("mgpu-prefill", name, kv, ps, d, group, width)
    lens = np.array([0, 1, ps - 1, ps + 1, ps + ps // 2 + T, width * ps])
    counts = np.minimum(np.array([0, 1, T, T - 2, T, 5]), lens)
    real = np.arange(T)[None, :] < counts[:, None]  # (B, T)
    positions = np.where(real, (lens - counts)[:, None] + np.arange(T)[None, :], -1)
    b, h = len(lens), KVH * group
    pages = b * width + 3
    k, v, ks, vs = make_pool(rng, LAYERS, KVH, pages, ps, d, kv, jnp.bfloat16)
    pt = permuted_page_table(rng, b, width, pages)
    q = jnp.asarray(rng.standard_normal((b, T, h, d)), jnp.float32).astype(jnp.bfloat16)
    pos, lens = jnp.asarray(positions, jnp.int32), jnp.asarray(lens, jnp.int32)
    return q, k, v, pos, lens, pt, ks, vs, real


def _check(out, ref, real, kv="auto", msg=""):
    out32 = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out32).all(), msg  # padding tokens: any finite value
    assert (out32[0] == 0).all(), msg  # seq_len 0: zeros, never NaN
    np.testing.assert_allclose(
        out32[real],
        np.asarray(ref.astype(jnp.float32))[real],
        atol=tolerance(jnp.bfloat16, kv),
        rtol=0,
        err_msg=msg,
    )


@pytest.mark.parametrize(
    "kv, ps, d, group, width, config",
    [
        # bf16 pages, 4 pages a 64-key tile, 3 tiles (one refill); GQA group 4: 2 row tiles
        ("auto", 16, 64, 4, 9, DEFAULT),
        # int8 pages (scales copied as scalars: 32-byte pages of scales), 8 pages a tile, 4
        # tiles in a 3-slot ring; group 3 padded to 4 rows a token
        ("int8", 8, 64, 3, 25, DEEP),
        # fp8 pages (scales by TMA: 128-byte pages of scales), 128-key tiles; no GQA: 64
        # tokens a row tile
        ("fp8", 32, 64, 1, 5, WIDE),
        # one page a tile, head_dim 128, group 8: 3 row tiles of 8 tokens
        ("auto", 64, 128, 8, 4, DEEP),
    ],
)
def test_prefill_matches_reference_in_interpret_mode(kv, ps, d, group, width, config):
    q, k, v, pos, lens, pt, ks, vs, real = _case("prefill", kv, ps, d, group, width)
    pool = PagedKV(k, v, ks, vs, 1)
    out = paged_prefill_mgpu(q, pool, pos, lens, pt, config=config, interpret=True)
    assert out.shape == q.shape and out.dtype == jnp.bfloat16
    _check(out, prefill_reference(q, pool, pos, lens, pt), real, kv)


def test_window_softcap_scale_and_layer_traced_under_jit():
    """One jitted program for sliding and global layers: the window and layer are traced. Windows
    of 1, mid-page (12), starting pages into the row (40), over two key tiles (128: a masked tile,
    an unmasked one, the masked diagonal), wider than every row (1000, the same as global), and 0
    (global)."""
    q, k, v, pos, lens, pt, _, _, real = _case("window", "auto", 16, 64, 2, 9)
    opts = dict(softcap=30.0, scale=0.2)
    run = jax.jit(
        lambda layer, window: paged_prefill_mgpu(
            q, PagedKV(k, v, layer=layer), pos, lens, pt, window=window, interpret=True, **opts
        )
    )
    for layer, window in ((1, 12), (0, 1), (1, 40), (0, 128), (0, 1000), (1, 0)):
        out = run(jnp.int32(layer), jnp.int32(window))
        ref = prefill_reference(q, PagedKV(k, v, layer=layer), pos, lens, pt, window=window, **opts)
        _check(out, ref, real, msg=f"layer {layer} window {window}")


@pytest.mark.parametrize("ps, block_k", [(8, 64), (16, 128), (64, 64)])
def test_tile_plan_walks_every_visible_key_and_masks_only_where_needed(ps, block_k):
    """Brute force over random ragged tiles: the walked key tiles [first page, + n tiles) hold
    every key a real token of the tile sees, and the unmasked tiles [i_a, i_b) only keys every
    real token sees."""
    rng = np.random.default_rng(ps + block_k)
    b, nt, tt, width = 64, 3, 8, 40
    lens = rng.integers(0, width * ps + 1, b)
    start = (lens[:, None] * rng.uniform(0, 1, (b, 1))).astype(int)
    pos = start + np.arange(nt * tt)[None, :]
    pos = np.where(pos < lens[:, None], pos, -1)  # padding past each row's length
    pos[rng.uniform(size=pos.shape) < 0.1] = -1  # and some holes
    for window in (0, 1, 7, 50, 10**6):
        plan = np.asarray(
            _tile_plan(
                jnp.asarray(pos.reshape(b, nt, tt), jnp.int32),
                jnp.asarray(lens, jnp.int32),
                jnp.int32(window),
                ps,
                block_k,
            )
        )
        key = np.arange(width * ps + 2 * block_k)
        for bi in range(b):
            for ti in range(nt):
                p = pos[bi, ti * tt : (ti + 1) * tt]
                p = p[p >= 0][:, None]
                seen = (key <= p) & (key < lens[bi]) & ((window <= 0) | (key > p - window))
                first, i_a, i_b, n = plan[bi, ti]
                k0 = first * ps
                assert 0 <= i_a <= i_b <= n, (bi, ti, plan[bi, ti])
                walked = (key >= k0) & (key < k0 + n * block_k)
                assert not (seen.any(0) & ~walked).any(), (bi, ti, window)
                whole = (key >= k0 + i_a * block_k) & (key < k0 + i_b * block_k)
                assert seen[:, whole].all(), (bi, ti, window)


def _args(**over):
    a = dict(
        q=jnp.zeros((2, 3, 4, 64), jnp.bfloat16),
        k_pages=jnp.zeros((1, 2, 8, 16, 64), jnp.bfloat16),
        v_pages=jnp.zeros((1, 2, 8, 16, 64), jnp.bfloat16),
        positions=jnp.zeros((2, 3), jnp.int32),
        seq_lens=jnp.asarray([3, 20], jnp.int32),
        page_table=jnp.asarray([[0, 1], [2, 3]], jnp.int32),
    )
    a.update(over)
    return a


def _pool(ps=16, d=64, dtype=jnp.bfloat16):
    z = jnp.zeros((1, 2, 8, ps, d), dtype)
    return dict(k_pages=z, v_pages=z)


@pytest.mark.parametrize(
    "over, match",
    [
        (dict(q=jnp.zeros((2, 3, 4, 64), jnp.float32)), "bf16 queries only"),
        (dict(q=jnp.zeros((2, 3, 4, 32), jnp.bfloat16), **_pool(d=32)), "head_dim must be 64"),
        (dict(seq_lens=jnp.asarray([3, 5], jnp.int32), **_pool(ps=4)), "page_size must be"),
        (dict(**_pool(dtype=jnp.float32)), "KV pages must be bf16, int8 or fp8"),
        (dict(q=jnp.zeros((2, 3, 130, 64), jnp.bfloat16)), "GQA group of 65 heads exceeds 64"),
        # the checks it shares with the Triton kernel
        (dict(positions=jnp.zeros((2, 2), jnp.int32)), r"positions must be i32\[2, 3\]"),
        (dict(page_table=jnp.asarray([[0, 1], [2, 8]], jnp.int32)), r"page_table\[1, 1\] = 8"),
    ],
)
def test_rejects_what_it_does_not_support(over, match):
    with pytest.raises(ValueError, match=match):
        paged_prefill_mgpu(**with_kv(_args(**over)), interpret=True)


def test_rejects_a_ring_larger_than_smem():
    big = MgpuPrefillConfig(num_buffers=4)  # 4 x 64 keys x 256 x 2 bytes x (K, V) = 256 KiB
    a = _args(q=jnp.zeros((2, 3, 4, 256), jnp.bfloat16), **_pool(d=256))
    with pytest.raises(ValueError, match="bytes of SMEM"):
        paged_prefill_mgpu(**with_kv(a), config=big)


# ------------------------------------------------------------------------------------------------
# Deviceless compile for an H100.


@pytest.mark.parametrize("kv, max_spill", [("auto", 0), ("fp8", 64)])
def test_compiles_deviceless_for_h100_at_8b_prefill_shape(kv, max_spill, tmp_path, monkeypatch):
    """Llama-3-8B prefill: 2 rows of 512-token chunks, 32 query heads over 8 KV heads, head_dim
    128, pages of 16, 4096 positions, bf16 queries; bf16 or fp8 pages. XLA compiles the Mosaic
    GPU custom call (MLIR -> PTX -> ptxas for sm_90a inside it) with no Triton call; ptxas's
    registers and spills are printed (bf16: none; fp8 pages: a few bytes, the dequantized tile
    on top of the f32 accumulator)."""
    from jax.sharding import NamedSharding, PartitionSpec

    monkeypatch.setenv("MOSAIC_GPU_DUMP_TO", str(tmp_path))
    monkeypatch.setenv("MOSAIC_GPU_DUMP_PTXAS", "1")
    target = deviceless.target("h100")
    mesh = deviceless.gpu_mesh(target)
    rep = NamedSharding(mesh, PartitionSpec())

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=rep)

    b, t, h, kvh, d, ps, positions, layers, pages = 2, 512, 32, 8, 128, 16, 4096, 32, 4096
    kv_dt = jnp.bfloat16 if kv == "auto" else jnp.float8_e4m3fn
    pages_sds = sds((layers, kvh, pages, ps, d), kv_dt)
    scale = None if kv == "auto" else sds((layers, kvh, pages, ps), jnp.float32)
    pool = PagedKV(pages_sds, pages_sds, scale, scale, sds((), jnp.int32))
    args = (sds((b, t, h, d), jnp.bfloat16), pool, sds((b, t), jnp.int32))
    args += (sds((b,), jnp.int32), sds((b, positions // ps), jnp.int32))
    program = deviceless.compile_for_gpu(
        "mgpu_prefill", jax.jit(paged_prefill_mgpu), args, {}, mesh
    )

    # one custom call, the Mosaic GPU kernel: no Pallas Triton call (XLA may still emit one of
    # its own small fusions, the tile plan's concatenate, with its Triton emitter)
    calls = re.findall(r'custom_call_target="([^"]+)"', program.hlo)
    assert calls == ["mosaic_gpu_v2"], calls
    # the kernel, and XLA's kernels around it: (layer, window) scalars, the tile plan (a reduce
    # and a concatenate), page-table padding, positions per row, q and output transposes
    thunks = re.findall(r"^\s*\d+: (\w+)", program.thunks, re.M)
    assert thunks.count("kCustomCall") == 1, program.thunks
    assert thunks.count("kCustomKernel") <= 7, program.thunks
    ptxas = "".join(open(f).read() for f in glob.glob(str(tmp_path / "*.ptxas")))
    for f in tmp_path.iterdir():  # MOSAIC_GPU_DUMP_TO writes every dump (~23 MB of pass logs)
        f.unlink()
    assert re.search(r"Compiling entry function 'mgpu_paged_prefill_\w+' for 'sm_90a'", ptxas)
    regs = re.search(r"Used (\d+) registers", ptxas)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", ptxas)
    assert regs and spill, ptxas
    print(f"\nptxas, kv-{kv}: {regs.group(1)} registers, {spill.group(0)}")
    assert int(spill.group(1)) <= max_spill, ptxas
