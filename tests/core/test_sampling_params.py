"""SamplingParams validation and the host-side SlotRow it turns into."""

import jax
import numpy as np
import pytest

from jaxserve.core.sampling_params import (
    MAX_STOP_IDS,
    SamplingParams,
    SlotRow,
    make_slot_row,
    seed_key_data,
)

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
    ("logprobs", -1),
    ("logprobs", 21),
    ("prompt_logprobs", 21),
    ("prompt_logprobs", 1.0),
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
    assert sp.stop is None and sp.stop_token_ids is None
    assert not sp.greedy and SamplingParams(temperature=0).greedy
    d = {
        "temperature": 1,
        "stop": "###",
        "stop_token_ids": [5, 6],
        "seed": np.int64(3),
        "top_k": -1,
    }
    sp = SamplingParams.from_dict(d)
    assert isinstance(sp.temperature, float) and sp.stop == ("###",) and sp.stop_token_ids == (5, 6)
    assert sp.seed == 3 and type(sp.seed) is int
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    hash(sp)  # frozen and hashable with tuples


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
    # ignore_eos drops eos from the suppressed ids; min_tokens == 0 needs none.
    row = make_slot_row(
        SamplingParams(min_tokens=1, ignore_eos=True, stop_token_ids=[9]), [1], [], (2,), 0, 4
    )
    assert row.stop_ids[:2].tolist() == [9, -1]
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
