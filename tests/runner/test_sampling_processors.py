"""allowed_token_ids, bad_words and logit_bias on the device (vLLM v1's logits processors, issue 25).

vLLM applies, before penalties and temperature: the allowed-token mask, bad words (the last token
of a word whose other tokens are the last generated ones), then logit_bias
(`vllm/v1/sample/sampler.py: apply_logits_processors`, `vllm/v1/sample/ops/bad_words.py`). Ported
cases: vLLM's tests/v1/sample/test_sampler.py (test_sampler_allowed_token_ids,
test_sampler_bad_words, test_sampler_logit_bias).
"""

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.slot_row import make_slot_row
from jaxserve.runner import sampling

S, V, K = 4, 32, 2
SAMPLE = jax.jit(sampling.sample, static_argnums=3)
SET_SLOT = jax.jit(sampling.set_slot, donate_argnums=0)
UPDATE = jax.jit(sampling.update_counts, donate_argnums=0)
PROCESS = jax.jit(sampling.apply_logits_processors)


class _CharTokenizer:  # a=1, b=2, ..., space=27
    def encode(self, text, add_special_tokens=False):
        return [27 if ch == " " else ord(ch) - 96 for ch in text]


def _state(rows):
    state = sampling.init_state(S, V)
    for slot, row in enumerate(rows):
        state = SET_SLOT(state, jnp.int32(slot), row)
    return state


def _row(sp, output=()):
    return make_slot_row(sp, [1], list(output), (0,), seed=0, max_model_len=16)


def test_allowed_token_ids_mask_every_other_token():
    rows = [_row(SamplingParams(temperature=0, allowed_token_ids=[3, 7])), _row(SamplingParams())]
    state = _state(rows)
    logits = jnp.zeros((S, V))
    got = np.asarray(PROCESS(logits, state))
    assert np.isfinite(got[0]).nonzero()[0].tolist() == [3, 7]
    assert np.isfinite(got[1:]).all()  # other slots (and never-used ones) untouched
    best = jnp.zeros((S, V)).at[:, 5].set(10.0).at[:, 7].set(1.0)
    tokens = SAMPLE(best, state, jnp.zeros((S,), jnp.int32), K).tokens
    assert int(tokens[0]) == 7 and int(tokens[1]) == 5  # slot 1 samples, but token 5 dominates


def test_logit_bias_added_and_changes_greedy_choice():
    sp = SamplingParams(temperature=0, logit_bias={4: 100.0, 2: -0.5})
    state = _state([_row(sp), _row(SamplingParams(temperature=0))])
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(S, V)), jnp.float32)
    got = np.asarray(PROCESS(logits, state))
    want = np.asarray(logits).copy()
    want[0, 4] += 100.0
    want[0, 2] -= 0.5
    np.testing.assert_allclose(got, want, rtol=1e-6)
    out = SAMPLE(logits, state, jnp.zeros((S,), jnp.int32), K)
    assert int(out.tokens[0]) == 4 and int(out.tokens[1]) == int(jnp.argmax(logits[1]))
    # log-probs stay those of the raw model distribution (vLLM's default logprobs mode)
    raw = jax.nn.log_softmax(logits[0])[4]
    np.testing.assert_allclose(float(out.logprobs[0]), float(raw), atol=1e-5)


def test_bad_words_ban_the_last_token_after_its_prefix():
    """vLLM's _apply_bad_words_single_batch: a one-token word is always banned; a longer word's
    last token only right after its other tokens were generated (prompt tokens do not count)."""
    sp = SamplingParams(temperature=0, bad_words=["c", "ab"]).with_bad_words_ids(_CharTokenizer())
    # slot 0: nothing generated yet; slot 1: generated ...a; slot 2: generated ...b a
    rows = [_row(sp), _row(sp, output=[5, 1]), _row(sp, output=[2, 1, 2])]
    state = _state(rows)
    got = np.isinf(np.asarray(PROCESS(jnp.zeros((S, V)), state)))
    assert got[0].nonzero()[0].tolist() == [3]  # "c" only
    assert got[1].nonzero()[0].tolist() == [2, 3]  # "c", and "b" after "a"
    assert got[2].nonzero()[0].tolist() == [3]  # last token is b, not a
    # the history follows generated tokens: slot 2 now generates "a", so "b" is banned next
    state = UPDATE(
        state, jnp.array([1, 0, 1, 0], jnp.int32), jnp.array([False, False, True, False])
    )
    got = np.isinf(np.asarray(PROCESS(jnp.zeros((S, V)), state)))
    assert got[2].nonzero()[0].tolist() == [2, 3]
    assert got[0].nonzero()[0].tolist() == [3]  # inactive slot 0 did not move
    # greedy would pick "b" (2) after "a": it picks the next best instead
    logits = jnp.zeros((S, V)).at[:, 2].set(5.0).at[:, 9].set(1.0)
    tokens = SAMPLE(logits, state, jnp.zeros((S,), jnp.int32), K).tokens
    assert int(tokens[2]) == 9 and int(tokens[0]) == 2


def test_processors_keep_shapes_no_recompilation():
    state = sampling.init_state(S, V)
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(S, V)), jnp.float32)
    steps = jnp.zeros((S,), jnp.int32)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, seed=1, logit_bias={i: 0.1 for i in range(20)}),
        SamplingParams(allowed_token_ids=list(range(10))),
        SamplingParams(temperature=0, bad_words=["ab", "c"]).with_bad_words_ids(_CharTokenizer()),
    ]
    for i, sp in enumerate(params * 2):
        state = SET_SLOT(state, jnp.int32(i % S), _row(sp, output=[1, 2][: i % 3]))
        out = SAMPLE(logits, state, steps, K)
        state = UPDATE(state, out.tokens, jnp.ones((S,), bool))
        sizes = (SAMPLE._cache_size(), SET_SLOT._cache_size(), UPDATE._cache_size())
        if i == 0:
            warm = sizes
        assert sizes == warm, f"recompiled at request {i}"
