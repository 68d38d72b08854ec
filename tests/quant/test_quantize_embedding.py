"""Quantized embedding tables: quantize_params' lm_head view, the model on it, and bad input."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_testing import model_step, sequence_meta

from jaxserve.config import ModelConfig
from jaxserve.layers import kv_cache as kvc
from jaxserve.layers.embedding import is_quantized
from jaxserve.models import llama
from jaxserve.quant import EMBEDDING_METHODS, METHODS, int8, quantize_params, rtn

TINY = ModelConfig.preset("tiny")


def _forward(params, config):
    b, t, ps = 2, 8, 8
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, config.vocab_size, (b, t)), jnp.int32)
    meta = sequence_meta([[0], [1]], [0, 0], [t, t - 2], t, ps, 1)
    cache = kvc.init(
        config.num_layers, config.num_kv_heads, 2, ps, config.head_dim, "auto", jnp.float32
    )
    logits, _ = model_step(params, tokens, meta, cache, config)  # jit, layers under lax.scan
    return np.asarray(logits)


@jax.jit  # one compile instead of a dozen eager dequantizations
def _dequantized(params):
    """Every quantized leaf as f32 floats; the embed back in its plain [V, D] orientation."""
    deq = jax.tree.map(
        lambda w: w.dequantize() if is_quantized(w) else w, params, is_leaf=is_quantized
    )
    return {**deq, "embed": deq["embed"].T}


def test_model_on_a_quantized_tied_embedding_equals_its_dequantized_floats():
    # Untied INT4/INT8 (embed looked up, lm_head separate) is test_int4.py's tiny-model test.
    config = dataclasses.replace(TINY, tie_word_embeddings=True)
    params = llama.init_params(config, jax.random.key(0), jnp.float32)
    q = quantize_params(params, config, "int4-rtn", group_size=32)
    assert is_quantized(q["embed"]) and q["embed"].shape == (config.hidden_size, config.vocab_size)
    llama.check_params(q, config)
    assert llama.model_dtype(q) == jnp.float32
    got, want, orig = (
        _forward(q, config),
        _forward(_dequantized(q), config),
        _forward(params, config),
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    err = np.linalg.norm(got - orig) / np.linalg.norm(orig - orig.mean(-1, keepdims=True))
    assert 0 < err < 0.5, err  # really quantized, and close to the float model


def test_embedding_is_rtn_of_the_lm_head_view_and_can_stay_float():
    config = dataclasses.replace(TINY, tie_word_embeddings=True)
    params = llama.init_params(config, jax.random.key(1), jnp.float32)
    # A tied table defaults to INT8 (it is also the lm_head); INT4 is asked for explicitly.
    default = quantize_params(params, config, "int4-rtn-asym", group_size=64)
    assert isinstance(default["embed"], int8.Int8Weight)
    q = quantize_params(
        params, config, "int4-rtn-asym", group_size=64, embedding_method="int4-rtn-asym"
    )
    ref = rtn.quantize_int4_rtn(params["embed"].T, 64, symmetric=False)  # (D, V)
    np.testing.assert_array_equal(np.asarray(q["embed"].packed), np.asarray(ref.packed))
    ids = jnp.arange(config.vocab_size)
    np.testing.assert_array_equal(  # rows looked up == the table the tied logits multiply by
        np.asarray(q["embed"].take(ids)), np.asarray(q["embed"].dequantize()).T
    )
    kept = quantize_params(params, config, "int8", quantize_embedding=False)
    assert kept["embed"] is params["embed"] and is_quantized(kept["layers"]["wq"])
    mixed = quantize_params(params, config, "int4-rtn-asym", 64, embedding_method="int8")
    assert isinstance(mixed["embed"], int8.Int8Weight) and mixed["embed"].shape == (64, 128)


def test_bad_embeddings_raise():
    params = llama.init_params(TINY, jax.random.key(2), jnp.float32)
    done = {**params, "embed": int8.quantize_int8(params["embed"].T)}  # (D, V)
    llama.check_params(done, TINY)
    with pytest.raises(ValueError, match="embed is already quantized"):
        quantize_params(done, TINY, "int8")  # checked before the method runs
    odd = dataclasses.replace(TINY, vocab_size=100, tie_word_embeddings=True)  # 100 % 8 != 0
    p_odd = llama.init_params(odd, jax.random.key(3), jnp.float32)
    with pytest.raises(ValueError, match="vocab size 100 is not a multiple of 8"):
        quantize_params(p_odd, odd, "int4-rtn", group_size=32, embedding_method="int4-rtn")
    wrong = int8.quantize_int8(params["embed"])  # (V, D): not the lm_head view
    with pytest.raises(ValueError, match=r"embed is a quantized Int8Weight .* lm_head view"):
        llama.check_params({**done, "embed": wrong}, TINY)


def test_every_method_says_how_it_quantizes_the_embedding():
    # quantize_params' default (quantize_embedding=True) needs one entry per registered method.
    assert set(METHODS) <= set(EMBEDDING_METHODS), set(METHODS) - set(EMBEDDING_METHODS)
