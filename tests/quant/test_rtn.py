"""Round-to-nearest INT4: error bounds per group, exact zeros/constants, symmetric vs asymmetric."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.quant import int4, rtn


def _groups(a, g):
    return a.reshape(*a.shape[:-2], a.shape[-2] // g, g, a.shape[-1])


@pytest.mark.parametrize("g", [32, 128])
def test_symmetric_error_is_at_most_half_a_step_and_zero_is_exact(g):
    rng = np.random.default_rng(0)
    w = rng.normal(size=(2, 256, 40)).astype(np.float32)
    w[0, :g, 3] = 0.0  # an all-zero group
    w[1, 5, 7] = 0.0
    codes, scales, mins = map(np.asarray, rtn.quantize_rtn(jnp.asarray(w), g, symmetric=True))
    assert codes.dtype == np.uint8 and codes.max() <= 15 and scales.shape == (2, 256 // g, 40)
    np.testing.assert_array_equal(mins, -8 * scales)
    np.testing.assert_array_equal(scales, int4.to_stored(scales))  # already at stored precision
    deq = np.asarray(int4.pack(codes, scales, mins, g).dequantize())
    err = np.abs(_groups(deq - w, g))  # (2, G, g, 40)
    assert np.all(err <= 0.5 * scales[:, :, None, :] * (1 + 1e-3))
    assert deq[0, 0, 3] == 0.0 and np.all(deq[0, :g, 3] == 0.0) and deq[1, 5, 7] == 0.0


def test_asymmetric_error_bound_constant_groups_and_beats_symmetric_on_skewed_weights():
    rng = np.random.default_rng(1)
    w = rng.uniform(0.0, 1.0, size=(128, 32)).astype(np.float32)  # all positive: skewed
    w[:64, 0] = 0.25  # a constant group is exact
    codes, scales, mins = map(np.asarray, rtn.quantize_rtn(jnp.asarray(w), 64, symmetric=False))
    deq = np.asarray(int4.pack(codes, scales, mins, 64).dequantize())
    lo = _groups(w, 64).min(axis=-2)  # (G, N)
    bound = 0.5 * scales + np.abs(mins - lo)  # the stored min is lo rounded to f16
    assert np.all(np.abs(_groups(deq - w, 64)) <= bound[:, None, :] * (1 + 1e-3) + 1e-7)
    assert np.all(deq[:64, 0] == 0.25)
    sym = np.asarray(rtn.quantize_int4_rtn(jnp.asarray(w), 64, symmetric=True).dequantize())
    assert np.mean((deq - w) ** 2) < 0.5 * np.mean((sym - w) ** 2)


def test_group_size_must_divide_k():
    with pytest.raises(ValueError, match="K=96 is not a multiple of group_size=64"):
        rtn.quantize_rtn(jnp.ones((96, 8)), 64)
