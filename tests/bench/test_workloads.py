"""Built-in workloads: seeded, within their stated ranges, and identical after a JSON round trip."""

import numpy as np
import pytest

from jaxserve.bench.workloads import SPECS, Workload, make_workload


@pytest.mark.parametrize("name", sorted(SPECS))
def test_workload_matches_its_spec(name):
    spec = SPECS[name]
    w = make_workload(name, vocab_size=49152)
    assert w.num_requests == spec.num_requests
    plens = np.array([len(r.prompt_token_ids) for r in w.requests])
    olens = np.array([r.max_tokens for r in w.requests])
    assert plens.min() >= spec.prompt_len_min and plens.max() <= spec.prompt_len_max
    assert olens.min() >= 1 and olens.max() <= spec.output_cap
    toks = np.concatenate([r.prompt_token_ids for r in w.requests])
    assert toks.min() >= 32 and toks.max() < 49152
    if spec.output_dist == "fixed":
        assert (olens == spec.output_mean).all()
    else:
        # Geometric: the sample mean is within ~4 standard errors of the stated mean, and the
        # tail is long (some request at least 3x the mean).
        se = spec.output_mean / np.sqrt(spec.num_requests)
        assert abs(olens.mean() - spec.output_mean) < 4 * se
        assert olens.max() >= 3 * spec.output_mean
    assert w.total_output_tokens == olens.sum()
    assert w.max_seq_len == (plens + olens).max()


def test_seeded_and_overridable():
    a = make_workload("longtail", vocab_size=128, num_requests=20, seed=3)
    b = make_workload("longtail", vocab_size=128, num_requests=20, seed=3)
    c = make_workload("longtail", vocab_size=128, num_requests=20, seed=4)
    assert a == b
    assert a.requests != c.requests
    assert a.num_requests == 20
    assert a.description.startswith("20 req,")  # the label follows the override
    # tiny vocab: ids stay in [vocab // 4, vocab)
    toks = np.concatenate([r.prompt_token_ids for r in a.requests])
    assert toks.min() >= 32 and toks.max() < 128


def test_json_round_trip(tmp_path):
    w = make_workload("longtail-small", vocab_size=1000, num_requests=5)
    path = tmp_path / "w.json"
    w.to_json(path)
    assert Workload.from_json(path) == w


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"name": "nope", "vocab_size": 100}, "workload"),
        ({"name": "longtail", "vocab_size": 100, "num_requests": 0}, "num_requests"),
        ({"name": "longtail", "vocab_size": 4}, "vocab_size"),
    ],
)
def test_bad_input_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        make_workload(**kwargs)
