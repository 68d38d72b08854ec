"""RMSNorm: its fixed-order row sum is the same for a row whatever the other rows, and the norm
equals the f64 reference to f32 rounding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.layers.norm import rms_norm, row_sum


@pytest.mark.parametrize("d", [576, 64, 100, 4096])
def test_a_rows_sum_does_not_depend_on_the_other_rows(d):
    rng = np.random.default_rng(d)
    x = jnp.asarray(rng.standard_normal((48, 1, d)) * 3, jnp.float32)
    f = jax.jit(row_sum)
    alone = np.asarray(f(x[:1]))
    for rows in (2, 4, 7, 8, 12, 16, 32, 48):  # XLA's own reduce changes its order from 8 rows
        assert np.array_equal(np.asarray(f(x[:rows]))[:1], alone), rows
    want = np.sum(np.asarray(x, np.float64), axis=-1)
    np.testing.assert_allclose(np.asarray(f(x)), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_equals_the_reference(offset):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 3, 576)).astype(np.float32)
    w = rng.standard_normal(576).astype(np.float32)
    got = np.asarray(rms_norm(jnp.asarray(x), jnp.asarray(w), 1e-5, offset))
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + 1e-5) * (offset + w)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    bf = rms_norm(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16), 1e-5, offset)
    assert bf.dtype == jnp.bfloat16
