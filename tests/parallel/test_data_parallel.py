"""Data parallelism (and TP x DP) on 4 host CPU devices (a subprocess): greedy tokens identical to
one device, f32 log-probs within 1e-5, preemption (a small pool per shard) and prefix caching
inside the shards, a request larger than its shard failing alone, and nothing compiling after
warm-up. The TP 2 x DP 2 checks (tokens, log-probs, compilations) share one warmed engine
(`warm_tp2_dp2`): each is its own test."""

from __future__ import annotations

import pytest
from parallel_testing import result, run_cases

CASES = [
    "greedy_dp2",
    "warm_tp2_dp2",
    "preempt_dp2",
    "never_fit_dp2",
    "prefix_cache_dp2",
]


@pytest.fixture(scope="module")
def results():
    return run_cases(4, CASES)


@pytest.mark.parametrize("name", ["greedy_dp2", "warm_tp2_dp2"])
def test_greedy_tokens_identical(results, name):
    assert result(results, name)["equal"]


def test_logprobs_within_1e5_of_one_device(results):
    """The logits check of data parallelism (TP 2 x DP 2, the Llama 3.1 golden): every prompt
    token's log-prob and each sampled token's top 5, f32, against one device."""
    r = result(results, "warm_tp2_dp2")
    assert r["same_tokens"], "the top-5 tokens differ from one device's"
    assert r["max_diff"] < 1e-5, r["max_diff"]


def test_preemption_inside_a_shard(results):
    r = result(results, "preempt_dp2")
    assert r["equal"] and r["num_preemptions"] > 0


def test_a_request_larger_than_its_shard_fails_alone(results):
    r = result(results, "never_fit_dp2")
    assert r["finish_reason"] == "error"
    assert "never fit" in r["message"] and "data shard's pool has 10" in r["message"]


def test_prefix_caching_inside_a_shard(results):
    r = result(results, "prefix_cache_dp2")
    assert r["equal"] and r["num_cached_prefill_tokens"] > 0


def test_nothing_recompiles_after_warmup(results):
    """The warmed TP 2 x DP 2 engine, through the greedy prompts, the log-probs requests (prompt
    log-probs: the prefill's scoring variant) and 10 short requests on its 4 slots."""
    assert result(results, "warm_tp2_dp2")["compilations"] == 0
