"""Expert parallelism on 4 host CPU devices (a subprocess): the MoE goldens (Mixtral, 8 experts;
Qwen3-MoE, 16; Qwen3-MoE with dense layers between, 4) at TP 2 and 4 split their expert stacks
over E (`layers/moe.py::_expert_parallel`): f32 logits within 1e-5 of one device (TP 4 on the
'tiled' grouped path, TP 2 on 'ragged_dot', the one-device run on 'ragged_dot'), greedy tokens
identical through the engine (float and INT8 experts), each device holding 1/T of every stack."""

from __future__ import annotations

import pytest
from parallel_testing import result, run_cases

CASES = [
    "moe_logits_tp2",
    "moe_logits_tp4",
    "moe_expert_split_tp2",
    "moe_greedy_tp2",
    "moe_int8_greedy_tp2",
    "moe_int4_kernel_tp2",
]


@pytest.fixture(scope="module")
def results():
    return run_cases(4, CASES)


@pytest.mark.parametrize("name", ["moe_logits_tp2", "moe_logits_tp4"])
def test_logits_match_one_device(results, name):
    for fam, diff in result(results, name).items():
        assert diff < 1e-5, (fam, diff)


def test_expert_stacks_split_over_experts(results):
    r = result(results, "moe_expert_split_tp2")
    assert r["loaded_spec"] == "P(None, 'model', None, None)"  # straight from the file
    for name in ("we_gate", "we_up", "we_down"):
        assert r[name] == {"spec": "P(None, 'model', None, None)", "fraction": 0.5}, name


@pytest.mark.parametrize("name", ["moe_greedy_tp2", "moe_int8_greedy_tp2"])
def test_greedy_tokens_identical(results, name):
    assert result(results, name)["equal"]


def test_quantized_experts_run_their_tiled_kernel_on_each_devices_stack(results):
    """The GPU's 'kernel' path (INT4 experts, the Triton kernel interpreted) under expert
    parallelism at TP 2: each device's tiles read its half of the experts in the layer stack;
    logits as one device's, which dequantizes them for ragged_dot; 3 tiled launches a MoE layer
    (a layer scan's body is traced once, so the jaxpr holds the launches of one layer)."""
    for fam, r in result(results, "moe_int4_kernel_tp2").items():
        assert r["diff"] < 1e-4, (fam, r)
        assert r["launches"] == 3, (fam, r)
