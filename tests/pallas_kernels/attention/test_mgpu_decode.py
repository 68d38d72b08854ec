"""Mosaic GPU decode kernel (`pallas_kernels.attention.mgpu_decode`): Mosaic GPU interpret mode on
the CPU against `decode_reference`, its refusals, and a deviceless compile for an H100.

Every interpret case batches the lengths 0, 1, ps-1, ps, ps+1 and the maximum (the whole page
table) as separate rows of one call, over a randomly permuted page table, and reads layer 1 of a
two-layer pool. The interpreter simulates SMEM, TMA copies, barriers and wgmma (operands read from
SMEM as the GPU does), so the ring's slot and barrier bookkeeping is checked, not only the math.
The deviceless compile runs the whole path to a cubin: jax's Pallas -> Mosaic GPU lowering, then,
inside XLA's compile of the `mosaic_gpu_v2` custom call, Mosaic GPU's MLIR -> PTX -> ptxas for
sm_90a (its ptxas report is read back through MOSAIC_GPU_DUMP_TO).
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

from pallas_kernels.attention.mgpu_decode import paged_attention_mgpu  # noqa: E402
from pallas_kernels.attention.paged_kv import PagedKV  # noqa: E402
from pallas_kernels.attention.reference import decode_reference  # noqa: E402
from pallas_kernels.attention.tuning import MgpuDecodeConfig  # noqa: E402

KVH, LAYERS, WIDTH = 2, 2, 5
# max_splits 2: the pages of a row are split over two programs (the log-sum-exp combine runs);
# num_buffers 3: the ring refills a slot while two others hold tiles.
SPLIT = MgpuDecodeConfig(max_splits=2)
DEEP = MgpuDecodeConfig(num_buffers=3, max_splits=1)


def _lens(ps):
    return np.array([0, 1, ps - 1, ps, ps + 1, WIDTH * ps], np.int32)


def _case(name, kv, ps, d, group):
    rng = np_seed("mgpu", name, kv, ps, d, group)
    lens = _lens(ps)
    b, h = len(lens), KVH * group
    pages = b * WIDTH + 3
    k, v, ks, vs = make_pool(rng, LAYERS, KVH, pages, ps, d, kv, jnp.bfloat16)
    pt = permuted_page_table(rng, b, WIDTH, pages)
    q = jnp.asarray(rng.standard_normal((b, h, d)), jnp.float32).astype(jnp.bfloat16)
    return q, k, v, jnp.asarray(lens), pt, ks, vs


@pytest.mark.parametrize(
    "kv, ps, d, group, config",
    [
        # bf16 pages, 4 pages a 64-key tile, GQA group 4, two splits
        ("auto", 16, 64, 4, SPLIT),
        # int8 pages (scales copied as scalars: 32-byte pages of scales), 8 pages a tile, group 3
        ("int8", 8, 64, 3, DEEP),
        # fp8 pages (scales by TMA: 128-byte pages of scales), 2 pages a tile, no GQA
        ("fp8", 32, 64, 1, SPLIT),
        # one page a tile, head_dim 128, group 8
        ("auto", 64, 128, 8, DEEP),
    ],
)
def test_decode_matches_reference_in_interpret_mode(kv, ps, d, group, config):
    q, k, v, lens, pt, ks, vs = _case("decode", kv, ps, d, group)
    pool = PagedKV(k, v, ks, vs, 1)
    out = paged_attention_mgpu(q, pool, lens, pt, config=config, interpret=True)
    ref = decode_reference(q, pool, lens, pt)

    assert out.shape == q.shape and out.dtype == jnp.bfloat16
    out32 = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out32).all()
    assert (out32[0] == 0).all()  # seq_len 0: zeros, never NaN
    np.testing.assert_allclose(
        out32,
        np.asarray(ref.astype(jnp.float32)),
        atol=tolerance(jnp.bfloat16, kv),
        rtol=0,
    )


def test_window_softcap_scale_and_layer_traced_under_jit():
    """One jitted program for sliding and global layers: the window and layer are traced. Windows
    of 1, mid-page (12) and wider than every row (1000, the same as global), and 0 (global)."""
    q, k, v, lens, pt, _, _ = _case("window", "auto", 16, 64, 2)
    opts = dict(softcap=30.0, scale=0.2)
    run = jax.jit(
        lambda layer, window: paged_attention_mgpu(
            q, PagedKV(k, v, layer=layer), lens, pt, window=window, config=SPLIT, interpret=True,
            **opts,
        )
    )  # fmt: skip
    for layer, window in ((1, 12), (0, 1), (1, 1000), (0, 0)):
        out = run(jnp.int32(layer), jnp.int32(window))
        ref = decode_reference(q, PagedKV(k, v, layer=layer), lens, pt, window=window, **opts)
        np.testing.assert_allclose(
            np.asarray(out.astype(jnp.float32)),
            np.asarray(ref.astype(jnp.float32)),
            atol=tolerance(jnp.bfloat16, "auto"),
            rtol=0,
            err_msg=f"layer {layer} window {window}",
        )


def _args(**over):
    a = dict(
        q=jnp.zeros((2, 4, 64), jnp.bfloat16),
        k_pages=jnp.zeros((1, 2, 8, 16, 64), jnp.bfloat16),
        v_pages=jnp.zeros((1, 2, 8, 16, 64), jnp.bfloat16),
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
        (dict(q=jnp.zeros((2, 4, 64), jnp.float32)), "bf16 queries only"),
        (dict(q=jnp.zeros((2, 4, 32), jnp.bfloat16), **_pool(d=32)), "head_dim must be 64"),
        (dict(seq_lens=jnp.asarray([3, 5], jnp.int32), **_pool(ps=4)), "page_size must be"),
        (dict(**_pool(dtype=jnp.float32)), "KV pages must be bf16, int8 or fp8"),
        (dict(q=jnp.zeros((2, 130, 64), jnp.bfloat16)), "GQA group of 65 heads exceeds 64"),
        # the checks it shares with the Triton kernel
        (dict(page_table=jnp.asarray([[0, 1], [2, 8]], jnp.int32)), r"page_table\[1, 1\] = 8"),
    ],
)
def test_rejects_what_it_does_not_support(over, match):
    with pytest.raises(ValueError, match=match):
        paged_attention_mgpu(**with_kv(_args(**over)), interpret=True)


def test_rejects_a_ring_larger_than_smem():
    q = jnp.zeros((1, 8, 256), jnp.bfloat16)
    k = jnp.zeros((1, 1, 4, 16, 256), jnp.bfloat16)
    lens, pt = jnp.asarray([3], jnp.int32), jnp.asarray([[0]], jnp.int32)
    big = MgpuDecodeConfig(num_buffers=4)  # 4 x 64 keys x 256 x 2 bytes x (K, V) = 256 KiB
    with pytest.raises(ValueError, match="bytes of SMEM"):
        paged_attention_mgpu(q, PagedKV(k, k), lens, pt, config=big)


# ------------------------------------------------------------------------------------------------
# Deviceless compile for an H100.


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_compiles_deviceless_for_h100_at_8b_decode_shape(kv, tmp_path, monkeypatch):
    """Llama-3-8B decode: 8 rows, 32 query heads over 8 KV heads, head_dim 128, pages of 16,
    4096 positions, bf16 queries; bf16 or fp8 pages. XLA compiles the Mosaic GPU custom call
    (Mosaic GPU's MLIR -> PTX -> ptxas for sm_90a happens inside it) with no Triton call."""
    from jax.sharding import NamedSharding, PartitionSpec

    monkeypatch.setenv("MOSAIC_GPU_DUMP_TO", str(tmp_path))
    monkeypatch.setenv("MOSAIC_GPU_DUMP_PTXAS", "1")
    target = deviceless.target("h100")
    mesh = deviceless.gpu_mesh(target)
    rep = NamedSharding(mesh, PartitionSpec())

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=rep)

    b, h, kvh, d, ps, positions, layers, pages = 8, 32, 8, 128, 16, 4096, 32, 4096
    kv_dt = jnp.bfloat16 if kv == "auto" else jnp.float8_e4m3fn
    pages_sds = sds((layers, kvh, pages, ps, d), kv_dt)
    scale = None if kv == "auto" else sds((layers, kvh, pages, ps), jnp.float32)
    pool = PagedKV(pages_sds, pages_sds, scale, scale, sds((), jnp.int32))
    args = (sds((b, h, d), jnp.bfloat16), pool, sds((b,), jnp.int32))
    args += (sds((b, positions // ps), jnp.int32),)
    program = deviceless.compile_for_gpu(
        "mgpu_decode", jax.jit(paged_attention_mgpu), args, {}, mesh
    )

    calls = re.findall(r'custom_call_target="([^"]+)"', program.hlo)
    assert calls == ["mosaic_gpu_v2"], calls
    assert "triton" not in program.hlo.lower()
    # the kernel, and XLA's kernels around it: (layer, window) scalars, the page-table and query
    # padding before it, the split-K combine (exp, reduce, slice of the real heads) after it
    thunks = re.findall(r"^\s*\d+: (\w+)", program.thunks, re.M)
    assert thunks.count("kCustomCall") == 1, program.thunks
    assert thunks.count("kCustomKernel") <= 6, program.thunks
    ptxas = "".join(open(f).read() for f in glob.glob(str(tmp_path / "*.ptxas")))
    for f in tmp_path.iterdir():  # MOSAIC_GPU_DUMP_TO writes every dump (~23 MB of pass logs)
        f.unlink()
    assert re.search(r"Compiling entry function 'mgpu_paged_decode_\w+' for 'sm_90a'", ptxas), ptxas
    assert "0 bytes spill stores" in ptxas, ptxas
