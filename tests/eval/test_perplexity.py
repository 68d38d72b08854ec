"""Perplexity: windows over the paged model equal a direct log-softmax over a dense forward."""

import jax
import numpy as np
import pytest
from ptq_testing import tiny_params

from jaxserve.config import ModelConfig
from jaxserve.eval.perplexity import perplexity
from jaxserve.layers.norm import rms_norm
from jaxserve.models import llama
from jaxserve.quant import calibration

CONFIG = ModelConfig.preset("tiny")


@jax.jit
def _dense_logp(params, tokens):
    """tokens i32[1, T] -> log softmax f32[T, V], dense causal attention, no cache."""
    x = params["embed"][tokens]
    for li in range(CONFIG.num_layers):
        x, _ = calibration.layer_forward(calibration.layer_slice(params, li), x, CONFIG)
    h = rms_norm(x, params["final_norm"], CONFIG.rms_norm_eps)
    return jax.nn.log_softmax(llama.compute_logits(params, h, CONFIG)[0], -1)


def _greedyish_text(params, n, seed=0):
    """The model's own continuation: argmax of a dense forward, with every 5th token random.
    Runs on a fixed [1, n] buffer (causal: the unfilled tail does not affect earlier logits)."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((1, n), np.int32)
    ids[0, 0] = 1
    for i in range(n - 1):
        logp = np.asarray(_dense_logp(params, ids))
        ids[0, i + 1] = rng.integers(CONFIG.vocab_size) if i % 5 == 4 else logp[i].argmax()
    return ids[0]


def _direct_nll(params, ids, window):
    """Sum over windows of -log softmax(logits[t])[ids[t + 1]]."""
    total = 0.0
    for s in range(0, len(ids), window):
        w = ids[s : s + window]
        logp = np.asarray(_dense_logp(params, np.asarray(w, np.int32)[None]))
        total -= logp[np.arange(len(w) - 1), w[1:]].sum()
    return total


def test_perplexity_matches_direct_log_softmax_on_own_text():
    params = tiny_params(CONFIG)
    ids = _greedyish_text(params, 32)
    ids = np.concatenate([ids, ids])  # 64 tokens: two full windows of 32
    r = perplexity(params, CONFIG, ids, window=32, batch=2)
    assert r["window"] == 32 and r["tokens"] == 2 * 31
    assert np.isfinite(r["ppl"]) and r["ppl"] > 1
    np.testing.assert_allclose(r["nll"], _direct_nll(params, ids, 32), rtol=1e-5)
    # The model's own (mostly greedy) text is likelier than uniform random tokens.
    rnd = np.random.default_rng(1).integers(0, CONFIG.vocab_size, 64)
    assert r["ppl"] < perplexity(params, CONFIG, rnd, window=32, batch=2)["ppl"]


def test_short_last_window_and_padding_rows_are_masked():
    params = tiny_params(CONFIG)
    ids = np.random.default_rng(2).integers(0, CONFIG.vocab_size, 75)  # windows 32, 32, 11
    r = perplexity(params, CONFIG, ids, window=32, batch=2)  # 3 windows -> one padding row
    assert r["tokens"] == 31 + 31 + 10
    np.testing.assert_allclose(r["nll"], _direct_nll(params, ids, 32), rtol=1e-5)


def test_bad_arguments_name_the_problem():
    params = {"embed": np.zeros((CONFIG.vocab_size, 4))}
    with pytest.raises(ValueError, match="at least 2 tokens"):
        perplexity(params, CONFIG, [3], window=32)
    with pytest.raises(ValueError, match="must lie in"):
        perplexity(params, CONFIG, [3, CONFIG.vocab_size], window=32)
    with pytest.raises(ValueError, match="window must be >= 2"):
        perplexity(params, CONFIG, [3, 4], window=1)
