"""`vocab_ops.top_k`: the two-pass top-k the sampler uses equals jax.lax.top_k, ties included."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runner import vocab_ops


@pytest.mark.parametrize(
    "n,v,k",
    [
        (1, 49152, 20),  # SmolLM2's vocabulary: 48 blocks
        (3, 128256, 20),  # Llama 3's: a ragged last block (128256 = 125 x 1024 + 256)
        (2, 5000, 1),
        (2, 3000, 1024),  # k = a whole block
        (4, 2048, 7),  # at most two blocks: one pass
        (2, 4096, 0),
    ],
)
def test_top_k_equals_lax_top_k(n, v, k):
    rng = np.random.default_rng(v + k)
    x = rng.normal(size=(n, v)).astype(np.float32)
    x[0, 100:160] = 3.0  # a run of ties across the top k, inside one block
    x[-1, ::997] = 4.0  # ties in many blocks
    x[-1, -300:] = -np.inf  # masked entries (a grammar), some in the padded last block
    want = jax.lax.top_k(jnp.asarray(x), k)
    got = jax.jit(vocab_ops.top_k, static_argnums=1)(jnp.asarray(x), k)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    assert got[1].dtype == jnp.int32


def test_top_k_of_a_row_of_minus_infinity_keeps_the_lowest_ids():
    x = jnp.full((1, 5000), -jnp.inf, jnp.float32).at[0, 4999].set(0.0)
    values, ids = vocab_ops.top_k(x, 3)
    assert ids.tolist() == [[4999, 0, 1]] and values[0, 0] == 0.0
