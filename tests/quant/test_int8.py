"""INT8 and FP8 (e4m3) weight-only: per-channel error bounds, matmul = x @ dequantize, checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.quant.int8 import Fp8Weight, Int8Weight, quantize_fp8, quantize_int8


def test_int8_per_channel_error_and_matmul():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(3, 96, 40)).astype(np.float32)
    q = quantize_int8(jnp.asarray(w))
    assert q.q.dtype == jnp.int8 and q.scales.shape == (3, 1, 40) and q.shape == (3, 96, 40)
    np.testing.assert_allclose(np.asarray(q.scales)[:, 0], np.abs(w).max(axis=1) / 127, rtol=1e-6)
    assert np.all(np.abs(np.asarray(q.dequantize()) - w) <= 0.5 * np.asarray(q.scales) * 1.0001)
    layer = jax.tree.map(lambda a: a[1], q)  # one layer, as lax.scan slices it
    x = jnp.asarray(rng.normal(size=(2, 5, 96)), jnp.float32)
    np.testing.assert_allclose(
        np.asarray(layer.matmul(x)), np.asarray(x @ layer.dequantize()), rtol=1e-5, atol=1e-5
    )
    with pytest.raises(ValueError, match="one layer"):
        q.matmul(x)


def test_fp8_relative_error_and_matmul():
    rng = np.random.default_rng(1)
    w = rng.normal(size=(64, 32)).astype(np.float32)
    q = quantize_fp8(jnp.asarray(w))
    assert q.q.dtype == jnp.float8_e4m3fn
    deq = np.asarray(q.dequantize())
    big = np.abs(w) > np.abs(w).max(axis=0) / 64  # e4m3 normals: 3 mantissa bits
    assert np.all(np.abs(deq - w)[big] <= np.abs(w)[big] / 16 + 1e-7)
    x = jnp.asarray(rng.normal(size=(4, 64)), jnp.bfloat16)
    got = np.asarray(q.matmul(x), np.float32)
    want = np.asarray(x, np.float32) @ deq
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


def test_grouped_int8_matmul_and_checks():
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.integers(-127, 128, size=(64, 16)), jnp.int8)
    scales = jnp.asarray(rng.uniform(0.01, 0.02, size=(2, 16)), jnp.float32)
    w = Int8Weight(q, scales, group_size=32)
    x = jnp.asarray(rng.normal(size=(3, 64)), jnp.float32)
    np.testing.assert_allclose(
        np.asarray(w.matmul(x)), np.asarray(x) @ np.asarray(w.dequantize()), rtol=1e-5, atol=1e-5
    )
    with pytest.raises(ValueError, match="scales has shape"):
        Int8Weight(q, scales, group_size=16).dequantize()
    with pytest.raises(ValueError, match="does not divide"):
        Int8Weight(q, scales, group_size=48).dequantize()
    with pytest.raises(ValueError, match="must be float8_e4m3fn"):
        Fp8Weight(q, scales, group_size=32).dequantize()


@pytest.mark.parametrize("quantize", [quantize_int8, quantize_fp8])
def test_kernel_impls_read_a_traced_layer_of_a_stack(quantize):
    """impl 'mgpu_interpret' (`quant/impls.py`): bf16 decode rows of a stack's traced layer run the
    Mosaic GPU W8A16 kernel in its interpreter; what that kernel refuses (f32 activations here)
    the Triton kernel's interpreter serves; past the kernels' row limit XLA's dot. Each equals the
    XLA path on the sliced layer."""
    from jaxserve.quant.int8 import PALLAS_MAX_ROWS

    rng = np.random.default_rng(0)
    w = quantize(jnp.asarray(rng.normal(size=(3, 128, 128)), jnp.float32))
    assert not w.replace(impl="xla").reads_layer_in_place
    for impl in ("mgpu_interpret", "pallas_interpret"):
        k = w.replace(impl=impl)
        assert k.reads_layer_in_place
        for rows, dtype in (
            (8, jnp.bfloat16),
            (8, jnp.float32),
            (PALLAS_MAX_ROWS + 8, jnp.bfloat16),
        ):
            x = jnp.asarray(rng.normal(size=(rows, 128)), dtype)
            got = jax.jit(lambda x, layer, k=k: k.matmul(x, layer=layer))(x, jnp.int32(2))
            one = w.replace(q=w.q[2], scales=w.scales[2])
            want = np.asarray(one.matmul(x), np.float32)
            assert got.dtype == dtype
            tol = 2e-2 * np.abs(want).max() if dtype == jnp.bfloat16 else 1e-4 * np.abs(want).max()
            np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0, atol=tol)


def test_mgpu_impl_runs_the_mosaic_kernel_where_it_accepts_the_call(monkeypatch):
    """The dispatch itself: bf16 rows go to the Mosaic GPU kernel, f32 rows to the Triton one."""
    from jaxserve.quant import int8

    calls = []
    real_mgpu, real_triton = int8.w8_matmul_mgpu, int8.w8_matmul
    monkeypatch.setattr(
        int8, "w8_matmul_mgpu", lambda *a, **k: calls.append("mgpu") or real_mgpu(*a, **k)
    )
    monkeypatch.setattr(
        int8, "w8_matmul", lambda *a, **k: calls.append(k["impl"]) or real_triton(*a, **k)
    )
    w = quantize_int8(jnp.ones((2, 128, 64), jnp.float32)).replace(impl="mgpu_interpret")
    w.matmul(jnp.ones((4, 128), jnp.bfloat16), layer=1)
    w.matmul(jnp.ones((4, 128), jnp.float32), layer=1)
    assert calls == ["mgpu", "pallas_interpret"]
