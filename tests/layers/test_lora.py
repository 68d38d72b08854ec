"""layers/lora.py: each row's adapter product equals its own slot's x @ a @ b, and no slot's for -1."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.layers import lora


def test_delta_is_each_rows_own_slot():
    rng = np.random.default_rng(0)
    n, d_in, r, d_out, b, t = 3, 8, 4, 5, 5, 2
    a = rng.normal(size=(n, d_in, r)).astype(np.float32)
    w = rng.normal(size=(n, r, d_out)).astype(np.float32)
    x = rng.normal(size=(b, t, d_in)).astype(np.float32)
    rows = np.array([2, -1, 0, 2, 1], np.int32)
    got = jax.jit(lora.delta)(x, a.transpose(1, 0, 2), w, rows)  # a as stored: [in, N, R]
    for i, s in enumerate(rows):
        want = np.zeros((t, d_out)) if s < 0 else x[i] @ a[s] @ w[s]
        np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-5)


def test_set_slot_writes_one_slot_of_every_layer():
    stack = {"wq": {"a": jnp.zeros((2, 4, 3, 2)), "b": jnp.zeros((2, 3, 2, 5))}}
    one = {"wq": {"a": np.ones((2, 4, 2), np.float32), "b": np.full((2, 2, 5), 2, np.float32)}}
    out = jax.jit(lora.set_slot, donate_argnums=0)(stack, np.int32(1), one)
    assert float(out["wq"]["a"][:, :, 1].min()) == 1 and float(out["wq"]["b"][:, 1].min()) == 2
    assert not out["wq"]["a"][:, :, [0, 2]].any() and not out["wq"]["b"][:, [0, 2]].any()
