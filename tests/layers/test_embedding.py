"""Embedding lookup: a row gather of a plain [V, D] table, a column gather of a quantized [D, V] one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.layers.embedding import embed, is_quantized
from jaxserve.quant import int8, pack

K, N = 64, 96  # D, V: N/8 = 12 packed columns, so ids hit every nibble plane


def _ids(rng, shape):
    ids = rng.integers(0, N, size=shape).astype(np.int32)
    ids.flat[:4] = [0, N - 1, N // 8, N // 8 - 1]  # plane edges: nibble 0/7, column 0/N/8-1
    return ids


def _int4(rng, g):
    codes = rng.integers(0, 16, size=(K, N), dtype=np.uint8)
    scales = rng.uniform(0.01, 0.1, size=(K // g, N)).astype(np.float32)
    mins = rng.uniform(-1.0, 0.0, size=(K // g, N)).astype(np.float32)
    return pack(codes, scales, mins, g)


@pytest.mark.parametrize("g", [32, 64])
def test_int4_take_is_the_dequantized_columns(g):
    rng = np.random.default_rng(0)
    w = _int4(rng, g)
    ids = _ids(rng, (3, 5))
    want = np.asarray(w.dequantize())[:, ids.reshape(-1)].T.reshape(3, 5, K)
    np.testing.assert_array_equal(np.asarray(w.take(jnp.asarray(ids))), want)
    got = jax.jit(lambda w, i: w.take(i, jnp.bfloat16))(w, jnp.asarray(ids))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got), want.astype(jnp.bfloat16))


@pytest.mark.parametrize("kind", ["int8", "int8-g32", "fp8"])
def test_int8_fp8_take_is_the_dequantized_columns(kind):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(K, N)).astype(np.float32))
    if kind == "int8-g32":
        w = int8.Int8Weight(
            jnp.asarray(rng.integers(-127, 128, size=(K, N)).astype(np.int8)),
            jnp.asarray(rng.uniform(0.01, 0.1, size=(K // 32, N)).astype(np.float32)),
            group_size=32,
        )
    else:
        w = int8.quantize_int8(x) if kind == "int8" else int8.quantize_fp8(x)
    ids = _ids(rng, (2, 7))
    want = np.asarray(w.dequantize())[:, ids.reshape(-1)].T.reshape(2, 7, K)
    np.testing.assert_array_equal(np.asarray(w.take(jnp.asarray(ids))), want)


def test_embed_plain_and_quantized_tables():
    rng = np.random.default_rng(2)
    w = _int4(rng, 32)
    table = w.dequantize().T  # (V, D): the same values as a plain table
    tokens = jnp.asarray(_ids(rng, (2, 4)))
    plain = embed(table, tokens, jnp.float32)
    assert plain.shape == (2, 4, K) and not is_quantized(table) and is_quantized(w)
    np.testing.assert_array_equal(np.asarray(embed(w, tokens, jnp.float32)), np.asarray(plain))
    assert embed(table, tokens, jnp.bfloat16).dtype == jnp.bfloat16
    np.testing.assert_array_equal(  # numpy tables (loaders' host arrays) gather rows too
        np.asarray(embed(np.asarray(table), tokens, jnp.float32)), np.asarray(plain)
    )


def test_bad_inputs_raise():
    w = _int4(np.random.default_rng(3), 32)
    with pytest.raises(ValueError, match="ids must be integers"):
        w.take(jnp.zeros((2,), jnp.float32))
    with pytest.raises(ValueError, match="needs one weight"):
        pack(np.zeros((2, K, N), np.uint8), np.ones((2, 2, N)), np.zeros((2, 2, N)), 32).take(
            jnp.zeros((1,), jnp.int32)
        )
    with pytest.raises(ValueError, match="embedding table must be"):
        embed({"q": 1}, jnp.zeros((1, 1), jnp.int32), jnp.float32)
