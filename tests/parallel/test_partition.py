"""Tensor parallelism on 4 host CPU devices (a subprocess): f32 logits of the tiny Llama, Mistral
and Qwen2 goldens within 1e-5 of one device at TP 1 (a 1-device mesh), 2 and 4 (4 query heads,
2 KV heads: TP 4 replicates the KV heads), greedy tokens identical through the engine, each device
holding 1/T of the params."""

from __future__ import annotations

import pytest
from parallel_testing import result, run_cases

from jaxserve.config import PRESETS, EngineConfig
from jaxserve.parallel.mesh import check_tensor_parallel, make_mesh

CASES = [
    "logits_tp1",
    "logits_tp2",
    "logits_tp4",
    "greedy_tp2",
    "greedy_tp4",
    "param_bytes_tp2",
    "param_bytes_tp4",
    "load_onto_shards_tp2",
]


@pytest.fixture(scope="module")
def results():
    return run_cases(4, CASES)


@pytest.mark.parametrize("name", ["logits_tp1", "logits_tp2", "logits_tp4"])
def test_logits_match_one_device(results, name):
    for family, err in result(results, name).items():
        assert err < 1e-5, (family, err)


@pytest.mark.parametrize("name", ["greedy_tp2", "greedy_tp4"])
def test_greedy_tokens_identical(results, name):
    assert result(results, name)["equal"]


@pytest.mark.parametrize("name", ["param_bytes_tp2", "param_bytes_tp4"])
def test_each_device_holds_its_share(results, name):
    assert abs(result(results, name)["ratio"] - 1.0) < 0.05


def test_sizes_that_do_not_divide_are_refused_with_the_numbers():
    tiny = PRESETS["tiny"]  # 4 heads, 2 KV heads, MLP 128
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size \(3\) must divide the model's query heads \(4\)"
    ):
        check_tensor_parallel(tiny, 3)
    smol = PRESETS["smollm2-135m"]  # 9 heads, 3 KV heads, MLP 1536
    check_tensor_parallel(smol, 3)
    with pytest.raises(ValueError, match=r"query heads \(9\)"):
        check_tensor_parallel(smol, 2)
    with pytest.raises(
        ValueError, match=r"\(1\) x tensor_parallel_size \(2\) = 2 devices, but only 1"
    ):
        make_mesh(2, 1)
    with pytest.raises(
        ValueError, match=r"num_slots \(5\) must be a multiple of data_parallel_size \(2\)"
    ):
        EngineConfig(num_slots=5, data_parallel_size=2)


def test_tensors_load_straight_onto_their_shards(results):
    for kind, r in result(results, "load_onto_shards_tp2").items():
        assert r["equal"], kind
        assert r["wq_spec"] == "P(None, None, 'model')" and r["wo_spec"] == "P(None, 'model', None)"
        assert r["wq_shard_fraction"] == 0.5, kind
