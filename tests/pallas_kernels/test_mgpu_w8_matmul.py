"""Mosaic GPU W8A16 matmul (`pallas_kernels.mgpu_w8_matmul`): Mosaic GPU interpret mode on the CPU
against the reference, its refusals, and a deviceless compile for an H100.

The interpreter simulates SMEM, TMA copies, barriers and wgmma, so the ring's slot and barrier
bookkeeping and the traced layer offset of the weight's TMA copies are checked, not only the math.
It is laxer than the compiler (it runs e4m3 -> bf16 conversions and ragged TMA column blocks that
Mosaic GPU refuses to lower for sm_90a), so the deviceless compile, int8 and fp8, is the other
half of the check: it runs the whole path to a cubin: jax's Pallas -> Mosaic GPU lowering, then,
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

from jaxserve.quant.int8 import quantize_fp8, quantize_int8  # noqa: E402
from pallas_kernels.mgpu_tuning import MgpuW8Config  # noqa: E402
from pallas_kernels.mgpu_w8_matmul import plan, reference, w8_matmul_mgpu  # noqa: E402

QUANTIZE = {"int8": quantize_int8, "fp8": quantize_fp8}
LAYERS = 3


def _stack(kind, k, n, seed=0):
    rng = np.random.default_rng(seed)
    w = QUANTIZE[kind](jnp.asarray(rng.normal(size=(LAYERS, k, n)), jnp.float32))
    return w.q, w.scales  # [L, K, N], f32[L, 1, N]


def _x(shape, seed=1):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.bfloat16)


def _check(got, x, q, scales, layer):
    ref = reference(x, q[layer], scales[layer])
    assert got.shape == ref.shape and got.dtype == jnp.bfloat16
    got32, ref32 = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(got32).all()
    # f32 sums in another order, rounded to bf16: a bf16 ulp or two of the largest output
    np.testing.assert_allclose(got32, ref32, rtol=1e-2, atol=1e-2 * np.abs(ref32).max())


# (M, K, N, config): the decode row counts 1, 8, 16, 64 (R = 8, 8, 16, 64 rows of x copied), split-K
# (2, planned 3 and 7), 64-column tiles (N = 192: not a multiple of 128), K = 448 (not a multiple
# of 128: 64-row K steps), rings of two and three slots (the refill of a slot), and a 512-row
# prefill chunk (eight 64-row blocks).
SPLIT2 = MgpuW8Config(splits=2)
DEEP = MgpuW8Config(num_buffers=3, splits=1, block_k=64)
CASES = [
    (1, 256, 128, SPLIT2),
    (8, 384, 192, None),
    (16, 448, 64, MgpuW8Config(num_buffers=3)),
    (64, 384, 256, DEEP),
    (512, 128, 64, None),
]


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("m, k, n, config", CASES)
def test_traced_layer_of_a_stack_matches_reference_in_interpret_mode(kind, m, k, n, config):
    """Layers 0 and 2 of a stack of 3 through one jitted program (the layer is traced), as the
    model's lax.scan hands the stack whole: the kernel reads that layer where it lies."""
    q, scales = _stack(kind, k, n)
    x = _x((m, k))
    run = jax.jit(lambda layer: w8_matmul_mgpu(x, q, scales, layer, config=config, interpret=True))
    outs = {layer: run(jnp.int32(layer)) for layer in (0, 2)}
    for layer, out in outs.items():
        _check(out, x, q, scales, layer)
    # the layers differ, so reading the wrong one (or the first K rows of the stack) would fail
    assert not np.allclose(np.asarray(outs[0], np.float32), np.asarray(outs[2], np.float32))


def test_one_layer_leading_dims_rows_past_64_and_out_dtype():
    """q [K, N] without a layer, x [2, 50, K] (100 rows: two 64-row blocks, the second ragged),
    f32 output."""
    q, scales = _stack("int8", 256, 64)
    x = _x((2, 50, 256))
    out = w8_matmul_mgpu(x, q[1], scales[1], None, out_dtype=jnp.float32, interpret=True)
    ref = reference(x, q[1], scales[1], jnp.float32)
    assert out.shape == (2, 50, 64) and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-3)


def test_plan_splits_decode_until_two_programs_per_sm():
    # Llama-3-8B up projection, 8 rows: 112 column blocks of 128, 32 K steps of 128 -> 4 splits
    p = plan(8, 4096, 14336)
    assert (p.rows, p.padded_m, p.block_n, p.block_k, p.splits) == (8, 8, 128, 128, 4)
    # down projection: 32 column blocks, 112 K steps -> the smallest divisor reaching 264: 14
    assert plan(8, 14336, 4096).splits == 14
    # prefill-sized row counts: 64-row blocks, enough programs without splitting
    p = plan(1000, 4096, 4096)
    assert (p.rows, p.padded_m, p.splits) == (64, 1024, 1)


def _args(**over):
    a = dict(
        x=jnp.zeros((4, 128), jnp.bfloat16),
        q=jnp.zeros((2, 128, 64), jnp.int8),
        scales=jnp.ones((2, 1, 64), jnp.float32),
        layer=1,
    )
    a.update(over)
    return a


@pytest.mark.parametrize(
    "over, match",
    [
        (dict(x=jnp.zeros((4, 128), jnp.float32)), "bf16 activations only.*float32"),
        (dict(x=jnp.zeros((4, 128), jnp.float16)), "bf16 activations only.*float16"),
        (dict(q=jnp.zeros((2, 128, 64), jnp.bfloat16)), "int8 or float8_e4m3fn, got bfloat16"),
        (
            dict(q=jnp.zeros((2, 128, 64), jnp.float8_e5m2)),
            "int8 or float8_e4m3fn, got float8_e5m2",
        ),
        (
            dict(x=jnp.zeros((4, 96), jnp.bfloat16), q=jnp.zeros((2, 96, 64), jnp.int8)),
            "K=96 must be a multiple of 64",
        ),
        (
            dict(q=jnp.zeros((2, 128, 208), jnp.int8), scales=jnp.ones((2, 1, 208), jnp.float32)),
            "N=208 must be a multiple of 64",
        ),
        (dict(scales=jnp.ones((2, 64), jnp.float32)), r"scales must be f32\[2, 1, 64\]"),
        (dict(layer=None), r"one layer's \[K, N\]"),
        (dict(layer=jnp.zeros((2,), jnp.int32)), "layer must be a scalar"),
        (dict(x=jnp.zeros((4, 64), jnp.bfloat16)), "its last dim must be K=128"),
    ],
)
def test_rejects_what_it_does_not_support(over, match):
    with pytest.raises(ValueError, match=match):
        w8_matmul_mgpu(**_args(**over), interpret=True)


def test_rejects_configs_that_do_not_fit():
    x, q = jnp.zeros((4, 256), jnp.bfloat16), jnp.zeros((2, 256, 256), jnp.int8)
    scales = jnp.ones((2, 1, 256), jnp.float32)
    cases = [
        # 8 x (16 + 32) KiB of ring, 64 KiB of bf16 tile
        (MgpuW8Config(block_n=256, num_buffers=8), "459776 bytes of SMEM .* exceed 232448"),
        (MgpuW8Config(splits=3), "splits=3 must divide the 2 K steps"),
    ]
    for config, match in cases:
        with pytest.raises(ValueError, match=match):
            w8_matmul_mgpu(x, q, scales, 0, config=config)
    with pytest.raises(ValueError, match="N=192 must be a multiple of 128"):
        w8_matmul_mgpu(x, q[..., :192], scales[..., :192], 0, config=MgpuW8Config(block_n=128))
    with pytest.raises(ValueError, match="block_k must be 64 or 128"):
        MgpuW8Config(block_k=32)


# ------------------------------------------------------------------------------------------------
# Deviceless compile for an H100.


@pytest.mark.parametrize(
    "k, n, kind", [(4096, 14336, "int8"), (14336, 4096, "int8"), (4096, 14336, "fp8")]
)
def test_compiles_deviceless_for_h100_at_8b_decode_shape(k, n, kind, tmp_path, monkeypatch):
    """Llama-3-8B MLP projections at decode: 8 rows of bf16, the 32-layer int8 (or fp8) stack and
    a traced layer. XLA compiles one Mosaic GPU custom call (Mosaic GPU's MLIR -> PTX -> ptxas for
    sm_90a happens inside it), no Triton call, and no copy of the layer's [K, N] slice: the stack
    reaches the kernel as a bitcast, and XLA's only kernel besides it is the split-K sum."""
    from jax.sharding import NamedSharding, PartitionSpec

    monkeypatch.setenv("MOSAIC_GPU_DUMP_TO", str(tmp_path))
    monkeypatch.setenv("MOSAIC_GPU_DUMP_PTXAS", "1")
    target = deviceless.target("h100")
    mesh = deviceless.gpu_mesh(target)
    rep = NamedSharding(mesh, PartitionSpec())

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=rep)

    layers = 32
    args = (
        sds((8, k), jnp.bfloat16),
        sds((layers, k, n), jnp.int8 if kind == "int8" else jnp.float8_e4m3fn),
        sds((layers, 1, n), jnp.float32),
        sds((), jnp.int32),
    )
    program = deviceless.compile_for_gpu("mgpu_w8", jax.jit(w8_matmul_mgpu), args, {}, mesh)

    calls = re.findall(r'custom_call_target="([^"]+)"', program.hlo)
    assert calls == ["mosaic_gpu_v2"], calls
    assert "triton" not in program.hlo.lower()
    # the stack reaches the kernel whole (a bitcast to [L*K, N]); nothing of a layer's size
    # (int8, or converted to bf16/f32) is made
    assert not re.search(rf"\[{k},{n}\]", program.hlo), program.hlo
    stack_uses = re.findall(rf"= (\S+)\[{layers * k},{n}\]\S* (\w+)\(", program.hlo)
    assert stack_uses and all(op == "bitcast" for _, op in stack_uses), stack_uses
    assert not re.search(r"\bcopy(-start)?\(", program.hlo), program.hlo
    thunks = re.findall(r"^\s*\d+: (\w+)", program.thunks, re.M)
    assert thunks == ["kCustomCall", "kCustomKernel"], program.thunks  # the kernel, the S-sum
    ptxas = "".join(open(f).read() for f in glob.glob(str(tmp_path / "*.ptxas")))
    for f in tmp_path.iterdir():  # MOSAIC_GPU_DUMP_TO writes every dump (MBs of pass logs)
        f.unlink()
    assert re.search(r"Compiling entry function 'mgpu_w8_matmul_\w+' for 'sm_90a'", ptxas), ptxas
    assert "0 bytes spill stores" in ptxas, ptxas
