"""Mosaic GPU W4A16 matmul (`pallas_kernels.mgpu_w4_matmul`): Mosaic GPU interpret mode on the CPU
against the reference, its refusals, `plan`, and a deviceless compile for an H100.

The interpreter simulates SMEM, TMA copies, barriers and wgmma, so the ring's slot and barrier
bookkeeping, the traced layer offsets of the packed codes' and the scales' TMA copies, the group
of each K step (one group over several steps, or several a step) and the plane -> column mapping
are checked, not only the math. It is laxer than the compiler, so the deviceless compile is the
other half of the check: jax's Pallas -> Mosaic GPU lowering, then, inside XLA's compile of the
`mosaic_gpu_v2` custom call, Mosaic GPU's MLIR -> PTX -> ptxas for sm_90a (its ptxas report is
read back through MOSAIC_GPU_DUMP_TO).
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

from jaxserve.quant import rtn  # noqa: E402
from pallas_kernels.mgpu_tuning import MgpuW4Config  # noqa: E402
from pallas_kernels.mgpu_w4_matmul import int4_matmul_mgpu, plan, reference  # noqa: E402

LAYERS = 3


def _stack(k, n, g, seed=0):
    """An asymmetric RTN INT4 stack [LAYERS, K, N] (packed u32[L, K, N/8], f16 scales/mins)."""
    w = np.random.default_rng(seed).normal(size=(LAYERS, k, n))
    q = rtn.quantize_int4_rtn(jnp.asarray(w, jnp.float32), g, symmetric=False)
    return q.packed, q.scales, q.mins


def _x(shape, seed=1):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.bfloat16)


def _check(got, x, packed, scales, mins, g, layer):
    ref = reference(x, packed[layer], scales[layer], mins[layer], g)
    assert got.shape == ref.shape and got.dtype == jnp.bfloat16
    got32, ref32 = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(got32).all()
    # bf16 weights (w = q*scale + min rounded once) and f32 sums in another order, rounded to
    # bf16: a bf16 ulp or two of the largest output
    np.testing.assert_allclose(got32, ref32, rtol=1e-2, atol=1e-2 * np.abs(ref32).max())


# (M, K, N, g, config): the decode row counts 1, 8, 16, 64 (R = 8, 8, 16, 64 rows of x copied) and
# 512 (eight 64-row blocks); split-K 2 and planned 6, and 1; g = 128 over two 64-row steps,
# g = 32 (two groups in every 64-row block: the row select), g = 64 with 128-row steps (one
# group per block); block_c 32 and 16, one column block or two (N = 256 at block_c 16, N = 512:
# plane j of block c is output columns j*N/8 + c*block_c ..); rings of two and three slots
# with refills (K = 512 in 128-row steps, K = 256 in 64-row steps).
CASES = [
    (1, 256, 256, 128, MgpuW4Config(splits=2)),
    (8, 384, 256, 32, MgpuW4Config(block_c=16)),
    (16, 512, 256, 32, MgpuW4Config(block_k=128, num_buffers=2, splits=1)),
    (64, 256, 512, 64, MgpuW4Config(block_k=128, splits=1)),
    (512, 128, 128, 128, MgpuW4Config(splits=1)),
]


@pytest.mark.parametrize("m, k, n, g, config", CASES)
def test_traced_layer_of_a_stack_matches_reference_in_interpret_mode(m, k, n, g, config):
    """Layers 0 and 2 of a stack of 3 through one jitted program (the layer is traced), as the
    model's lax.scan hands the stack whole: the kernel reads that layer where it lies."""
    packed, scales, mins = _stack(k, n, g)
    x = _x((m, k))

    def run(layer):
        return int4_matmul_mgpu(
            x, packed, scales, mins, group_size=g, layer=layer, config=config, interpret=True
        )

    run = jax.jit(run)
    outs = {layer: run(jnp.int32(layer)) for layer in (0, 2)}
    for layer, out in outs.items():
        _check(out, x, packed, scales, mins, g, layer)
    # the layers differ, so reading the wrong one (or the first K rows of the stack) would fail
    assert not np.allclose(np.asarray(outs[0], np.float32), np.asarray(outs[2], np.float32))


def test_one_layer_leading_dims_rows_past_64_and_out_dtype():
    """packed [K, N/8] without a layer, x [2, 50, K] (100 rows: two 64-row blocks, the second
    ragged), f32 output."""
    packed, scales, mins = _stack(128, 128, 64)
    x = _x((2, 50, 128))
    args = (packed[1], scales[1], mins[1])
    out = int4_matmul_mgpu(x, *args, group_size=64, out_dtype=jnp.float32, interpret=True)
    ref = reference(x, *args, 64, out_dtype=jnp.float32)
    assert out.shape == (2, 50, 128) and out.dtype == jnp.float32
    # the weights are rounded to bf16 in the kernel, not in the reference
    scale = float(np.abs(np.asarray(ref)).max())
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-2, atol=1e-2 * scale)


def test_plan_splits_decode_until_two_programs_per_sm():
    # Llama-3-8B up projection, 8 rows: 56 blocks of 32 packed columns (256 outputs), 64 K steps
    # of 64 -> the smallest divisor reaching 264 programs: 8
    p = plan(8, 4096, 14336)
    assert (p.rows, p.padded_m, p.block_c, p.block_k, p.splits) == (8, 8, 32, 64, 8)
    # down projection: 16 column blocks, 224 K steps -> no divisor <= 16 reaches 264: 16
    assert plan(8, 14336, 4096).splits == 16
    # N/8 = 80 is not a multiple of 32: 16-column blocks
    assert plan(1, 576, 640).block_c == 16
    # prefill-sized row counts: 64-row blocks, 16 x 16 = 256 programs -> 2 splits
    p = plan(1000, 4096, 4096)
    assert (p.rows, p.padded_m, p.splits) == (64, 1024, 2)


def _args(**over):
    a = dict(
        x=jnp.zeros((4, 128), jnp.bfloat16),
        packed=jnp.zeros((2, 128, 16), jnp.uint32),
        scales=jnp.ones((2, 1, 128), jnp.float16),
        mins=jnp.zeros((2, 1, 128), jnp.float16),
        group_size=128,
        layer=1,
    )
    a.update(over)
    return a


def _w(k, n, g=32, layers=2):
    return dict(
        packed=jnp.zeros((layers, k, n // 8), jnp.uint32),
        scales=jnp.ones((layers, k // g, n), jnp.float16),
        mins=jnp.zeros((layers, k // g, n), jnp.float16),
        group_size=g,
    )


@pytest.mark.parametrize(
    "over, match",
    [
        (dict(x=jnp.zeros((4, 128), jnp.float32)), "bf16 activations only.*float32"),
        (dict(x=jnp.zeros((4, 128), jnp.float16)), "bf16 activations only.*float16"),
        (dict(shards=2), "shards = 1 layout only, got shards=2"),
        (dict(x=jnp.zeros((4, 96), jnp.bfloat16), **_w(96, 128)), "K=96 must be a multiple of 64"),
        (_w(128, 192), "N=192 must be a multiple of 128"),
        (dict(scales=jnp.ones((2, 1, 64), jnp.float16)), r"scales has shape \(2, 1, 64\)"),
        (dict(mins=jnp.zeros((2, 1, 128), jnp.float32)), "mins must be float16"),
        (dict(group_size=256), "group_size must be one of"),
        (dict(layer=None), r"one layer's u32\[K, N/8\]"),
        (dict(layer=jnp.zeros((2,), jnp.int32)), "layer must be a scalar"),
        (dict(x=jnp.zeros((4, 64), jnp.bfloat16)), "its last dim must be K=128"),
    ],
)
def test_rejects_what_it_does_not_support(over, match):
    with pytest.raises(ValueError, match=match):
        int4_matmul_mgpu(**_args(**over), interpret=True)


def test_rejects_configs_that_do_not_fit():
    x = jnp.zeros((4, 256), jnp.bfloat16)
    w = _w(256, 256)
    cases = [
        # 8 x (16 KiB of x + 16 KiB of codes + 4 KiB of f16 scales and mins of 4 groups)
        # + 8 KiB of f32 factors + 64 KiB of bf16 planes
        (MgpuW4Config(block_k=128, num_buffers=8), "368640 bytes of SMEM .* exceed 232448"),
        (MgpuW4Config(splits=3), "splits=3 must divide the 4 K steps"),
    ]
    for config, match in cases:
        with pytest.raises(ValueError, match=match):
            int4_matmul_mgpu(x, **w, layer=0, config=config)
    with pytest.raises(ValueError, match="N=128 must be a multiple of 256"):
        int4_matmul_mgpu(x, **_w(256, 128), layer=0, config=MgpuW4Config(block_c=32))
    with pytest.raises(ValueError, match="block_c must be 16 or 32"):
        MgpuW4Config(block_c=64)
    with pytest.raises(ValueError, match="block_k must be 64 or 128"):
        MgpuW4Config(block_k=32)


# ------------------------------------------------------------------------------------------------
# Deviceless compile for an H100.


@pytest.mark.parametrize("k, n, g", [(4096, 14336, 128), (14336, 4096, 128), (4096, 14336, 32)])
def test_compiles_deviceless_for_h100_at_8b_decode_shape(k, n, g, tmp_path, monkeypatch):
    """Llama-3-8B MLP projections at decode: 8 rows of bf16, the 32-layer INT4 stack and a traced
    layer. XLA compiles one Mosaic GPU custom call (Mosaic GPU's MLIR -> PTX -> ptxas for sm_90a
    happens inside it), no Triton call, and no copy of the layer's slice: the stack reaches the
    kernel as bitcasts, and XLA's only kernel besides it is the split-K sum. ptxas spills
    nothing (g = 32 adds the row select of two groups a block)."""
    from jax.sharding import NamedSharding, PartitionSpec

    monkeypatch.setenv("MOSAIC_GPU_DUMP_TO", str(tmp_path))
    monkeypatch.setenv("MOSAIC_GPU_DUMP_PTXAS", "1")
    target = deviceless.target("h100")
    mesh = deviceless.gpu_mesh(target)
    rep = NamedSharding(mesh, PartitionSpec())

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=rep)

    layers, n8, groups = 32, n // 8, k // g
    args = (
        sds((8, k), jnp.bfloat16),
        sds((layers, k, n8), jnp.uint32),
        sds((layers, groups, n), jnp.float16),
        sds((layers, groups, n), jnp.float16),
        sds((), jnp.int32),
    )

    def fn(x, packed, scales, mins, layer):
        return int4_matmul_mgpu(x, packed, scales, mins, group_size=g, layer=layer)

    program = deviceless.compile_for_gpu("mgpu_w4", jax.jit(fn), args, {}, mesh)

    calls = re.findall(r'custom_call_target="([^"]+)"', program.hlo)
    assert calls == ["mosaic_gpu_v2"], calls
    assert "triton" not in program.hlo.lower()
    # the stack reaches the kernel whole (bitcasts to [L*K, N/8] and [L*G, 8, N/8]); nothing of a
    # layer's size is made
    assert not re.search(rf"\[{k},{n8}\]", program.hlo), program.hlo
    for shape in (rf"{layers * k},{n8}", rf"{layers * groups},8,{n8}"):
        uses = re.findall(rf"= (\S+)\[{shape}\]\S* (\w+)\(", program.hlo)
        assert uses and all(op == "bitcast" for _, op in uses), uses
    assert not re.search(r"\bcopy(-start)?\(", program.hlo), program.hlo
    thunks = re.findall(r"^\s*\d+: (\w+)", program.thunks, re.M)
    assert thunks == ["kCustomCall", "kCustomKernel"], program.thunks  # the kernel, the S-sum
    ptxas = "".join(open(f).read() for f in glob.glob(str(tmp_path / "*.ptxas")))
    for f in tmp_path.iterdir():  # MOSAIC_GPU_DUMP_TO writes every dump (MBs of pass logs)
        f.unlink()
    assert re.search(r"Compiling entry function 'mgpu_w4_matmul_\w+' for 'sm_90a'", ptxas), ptxas
    assert "0 bytes spill stores" in ptxas, ptxas
