"""The W8A16 kernel (interpret mode) against its pure-jnp reference, plus the XLA path, and the
INT8 / FP8 weights that run it on a layer of their stack."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.quant.int8 import quantize_fp8, quantize_int8
from pallas_kernels.w8_matmul import W8MatmulConfig, plan, w8_matmul, w8_matmul_reference

TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=2e-2, atol=1e-2)}
QUANTIZE = {"int8": quantize_int8, "fp8": quantize_fp8}


def _weight(kind, layers, k, n, seed=0):
    rng = np.random.default_rng(seed)
    return QUANTIZE[kind](jnp.asarray(rng.normal(size=(layers, k, n)), jnp.float32))


def _check(got, x, q, scales):
    ref = w8_matmul_reference(x, q, scales)
    assert got.shape == ref.shape and got.dtype == x.dtype
    scale = float(jnp.max(jnp.abs(ref.astype(jnp.float32))))
    tol = TOL[x.dtype.type]
    np.testing.assert_allclose(
        np.asarray(got, np.float32),
        np.asarray(ref, np.float32),
        rtol=tol["rtol"],
        atol=tol["atol"] * scale,
    )


# (rows, K, N, activations): M 1..100 (ragged: 3, 33, 100; past the decode tiles: 100), K 128 to
# 1536, ragged columns (N = 100, 192 against 64-column blocks), f32 and bf16 activations.
CASES = [
    ((1,), 576, 192, jnp.bfloat16),
    ((8,), 576, 1536, jnp.bfloat16),
    ((33,), 1536, 576, jnp.float32),
    ((64,), 256, 100, jnp.bfloat16),
    ((100,), 128, 192, jnp.float32),
    ((2, 3), 576, 576, jnp.bfloat16),
]


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("lead,k,n,dtype", CASES)
def test_pallas_interpret_equals_reference(kind, lead, k, n, dtype):
    w = _weight(kind, 1, k, n)
    q, scales = w.q[0], w.scales[0]
    x = jnp.asarray(np.random.default_rng(1).normal(size=(*lead, k)), dtype)
    _check(w8_matmul(x, q, scales, impl="pallas_interpret"), x, q, scales)
    _check(w8_matmul(x, q, scales, impl="xla"), x, q, scales)


@pytest.mark.parametrize("impl", ["pallas_interpret", "xla"])
def test_a_traced_layer_of_a_stack_equals_that_layer(impl):
    """The model's lax.scan hands the stack [L, K, N] whole with the layer index: the kernel reads
    that layer where it lies."""
    w = _weight("int8", 4, 576, 192)
    x = jnp.asarray(np.random.default_rng(2).normal(size=(5, 576)), jnp.bfloat16)

    def per_layer(carry, layer):
        return carry, w8_matmul(x, w.q, w.scales, impl=impl, layer=layer)

    _, ys = jax.lax.scan(per_layer, 0, jnp.arange(4))
    for layer in range(4):
        _check(ys[layer], x, w.q[layer], w.scales[layer])


@pytest.mark.parametrize("impl", ["pallas_interpret", "xla"])
def test_a_tiled_call_runs_each_tile_on_its_own_layer(impl):
    """A mixture of experts' call (`pallas_kernels/tiles.py`): tile t's 16 rows times layer
    tiles[t] of the stack, a negative tile's rows 0; a layer may serve two tiles."""
    w, b = _weight("fp8", 4, 576, 192), 16
    tiles = jnp.array([3, -1, 0, 3], jnp.int32)
    x = jnp.asarray(np.random.default_rng(3).normal(size=(len(tiles) * b, 576)), jnp.bfloat16)
    got = w8_matmul(x, w.q, w.scales, impl=impl, layer=tiles, tile_rows=b)
    for t, layer in enumerate(np.asarray(tiles)):
        rows = slice(t * b, (t + 1) * b)
        if layer < 0:
            assert not np.any(np.asarray(got[rows], np.float32)), t
        else:
            _check(got[rows], x[rows], w.q[layer], w.scales[layer])
    with pytest.raises(ValueError, match="4 tiles of 16 rows need 64"):
        w8_matmul(x[:48], w.q, w.scales, impl=impl, layer=tiles, tile_rows=b)


def test_forced_tiles_split_and_unsplit_agree():
    w = _weight("fp8", 1, 1024, 256)
    x = jnp.asarray(np.random.default_rng(3).normal(size=(4, 1024)), jnp.float32)
    outs = [
        w8_matmul(
            x, w.q[0], w.scales[0], impl="pallas_interpret", config=W8MatmulConfig(16, 64, bk, s)
        )
        for bk, s in ((128, 1), (64, 4), (32, 8))
    ]
    for out in outs[1:]:
        np.testing.assert_allclose(np.asarray(out), np.asarray(outs[0]), rtol=1e-5, atol=1e-4)


def test_plan_fills_the_gpu_and_divides_k():
    for m, k, n in [(1, 4096, 4096), (8, 4096, 1024), (64, 14336, 4096), (1, 576, 192)]:
        cfg = plan(m, k, n)
        steps = k // cfg.block_k
        assert k % cfg.block_k == 0 and steps % cfg.splits == 0, (m, k, n, cfg)
        assert cfg.block_m >= max(16, m) or m > 64
    assert plan(512, 4096, 4096).splits == 1  # prefill-sized: no split


def test_bad_inputs():
    w = _weight("int8", 1, 128, 64)
    x = jnp.zeros((2, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="impl"):
        w8_matmul(x, w.q[0], w.scales[0], impl="cuda")
    with pytest.raises(ValueError, match="int8 or float8"):
        w8_matmul(x, w.q[0].astype(jnp.int32), w.scales[0], impl="xla")
    with pytest.raises(ValueError, match="scales"):
        w8_matmul(x, w.q[0], jnp.ones((2, 64), jnp.float32), impl="xla")
    with pytest.raises(ValueError, match="last dim"):
        w8_matmul(jnp.zeros((2, 64), jnp.bfloat16), w.q[0], w.scales[0], impl="xla")
    with pytest.raises(ValueError, match="stack"):
        w8_matmul(x, w.q[0], w.scales[0], impl="xla", layer=0)
    with pytest.raises(ValueError, match="multiple of 16"):
        plan(1, 100, 64)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_weight_with_the_kernel_reads_its_stack_in_place(kind):
    """An Int8Weight / Fp8Weight with impl 'pallas*' keeps its stack whole under the layer scan
    (`reads_layer_in_place`) and multiplies a decode batch with the kernel: the same products as
    the XLA path, within bf16 rounding; a prefill-sized batch and grouped scales keep XLA's."""
    w = _weight(kind, 3, 256, 128)
    kernel = w.replace(impl="pallas_interpret")
    assert kernel.reads_layer_in_place and not w.reads_layer_in_place
    x = jnp.asarray(np.random.default_rng(4).normal(size=(8, 256)), jnp.bfloat16)
    got = jax.jit(lambda w, x: w.matmul(x, layer=jnp.int32(2)))(kernel, x)
    _check(got, x, w.q[2], w.scales[2])
    grouped = quantize_int8(jnp.ones((3, 256, 128))).replace(
        scales=jnp.ones((3, 8, 128), jnp.float32), group_size=32, impl="pallas"
    )
    assert not grouped.reads_layer_in_place
