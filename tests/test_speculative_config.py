"""vLLM's speculative_config dict and its batch-size schedule (`jaxserve/config/speculative.py`)."""

from __future__ import annotations

import pytest

from jaxserve.config.speculative import normalize_schedule, schedule_drafts, speculative_settings


def test_speculative_settings_map_vllms_keys():
    assert speculative_settings(None) == {}
    assert speculative_settings(
        {
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_max": 5,
            "prompt_lookup_min": 2,
            "disable_by_batch_size": 16,
        }
    ) == {
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 5,
        "prompt_lookup_min": 2,
        "speculative_disable_by_batch_size": 16,
    }
    # v0's spelling: the ngram "model"; JSON text as --speculative-config takes it
    assert speculative_settings({"model": "[ngram]", "num_speculative_tokens": 2}) == {
        "num_speculative_tokens": 2
    }
    assert speculative_settings('{"method": "ngram", "num_speculative_tokens": 2}') == {
        "num_speculative_tokens": 2
    }


@pytest.mark.parametrize(
    "config,match",
    [
        ({"method": "eagle", "num_speculative_tokens": 3}, "method 'ngram'"),
        ({"model": "some/draft-model", "num_speculative_tokens": 3}, "method 'ngram'"),
        ({"method": "ngram", "model": "some/draft", "num_speculative_tokens": 3}, "draft model"),
        ({"num_speculative_tokens": 3}, "method 'ngram'"),
        ({"method": "ngram"}, "num_speculative_tokens is required"),
        ({"method": "ngram", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1},
         "draft_tensor_parallel_size"),
        ("{not json", "not JSON"),
        ([1, 2], "must be a dict"),
    ],
)  # fmt: skip
def test_speculative_settings_refuse_what_jaxserve_does_not_do(config, match):
    with pytest.raises(ValueError, match=match):
        speculative_settings(config)


def test_schedule_is_checked_and_looked_up_as_vllm_does():
    s = normalize_schedule("[[9, 16, 1], [1, 4, 3], [20, 24, 0]]")  # JSON, unsorted
    assert s == ((1, 4, 3), (9, 16, 1), (20, 24, 0))
    drafts = [schedule_drafts(s, 3, n) for n in (1, 4, 5, 8, 9, 16, 17, 20, 24, 32)]
    # gaps keep the k before them, past the end the last k
    assert drafts == [3, 3, 3, 3, 1, 1, 1, 0, 0, 0]
    assert schedule_drafts(((1, 8, 5),), 3, 2) == 3  # never more than num_speculative_tokens
    assert schedule_drafts(None, 3, 100) == 3
    for bad, match in [
        ([], "non-empty"),
        ([[2, 4, 1]], "start at batch size 1"),
        ([[1, 4, 1], [4, 8, 0]], "overlap"),
        ([[1, 4]], "3 ints"),
        ([[1, 4, -1]], "k >= 0"),
        ([[3, 2, 1]], "first <= last"),
        ([[1, 4, True]], "3 ints"),
        ("[[1, 4", "JSON"),
    ]:
        with pytest.raises(ValueError, match=match):
            normalize_schedule(bad)


@pytest.mark.parametrize(
    "settings,field",
    [
        ({"num_speculative_tokens": 3, "prompt_lookup_max": 10**9}, "prompt_lookup_max"),
        ({"num_speculative_tokens": 3, "prompt_lookup_min": 33}, "prompt_lookup_min"),
        ({"num_speculative_tokens": 4096}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 2**40}, "num_speculative_tokens"),
    ],
)
def test_speculative_settings_are_bounded_by_what_compiles(settings, field):
    """Issue 58: prompt_lookup_max=10**9 never finished tracing, num_speculative_tokens=4096 ran
    out of memory and 2**40 overflowed inside jax; each is now a ValueError naming the field and
    its bound, through EngineConfig and through vLLM's speculative_config dict alike."""
    from jaxserve.config import EngineConfig
    from jaxserve.llm import LLM

    with pytest.raises(ValueError, match=f"{field} must be at most 32"):
        EngineConfig(**settings)
    with pytest.raises(ValueError, match=f"{field} must be at most 32"):
        LLM("tiny", load_format="dummy", speculative_config={"method": "ngram", **settings})
