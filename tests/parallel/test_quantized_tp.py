"""Quantized weights under tensor parallelism, through the engine on 4 host CPU devices (a
subprocess): an INT4-RTN checkpoint at TP 2, INT8 at TP 4 (above the 2 KV heads: replicated), and
SmolLM2-135M's GGUF Q4 blocks imported natively at TP 3 (9 query heads, 3 KV heads), each equal to
the one-device run of the same weights."""

from __future__ import annotations

import pytest
from parallel_testing import result, run_cases

CASES = ["int4_rtn_tp2", "int8_tp4", "smollm2_gguf_native_tp3", "staged_load_tp2"]
CASES += ["lora_tp2", "lora_int8_tp2", "lora_tp4"]


@pytest.fixture(scope="module")
def results():
    return run_cases(4, CASES)


@pytest.mark.parametrize("name", ["int4_rtn_tp2", "int8_tp4"])
def test_greedy_tokens_identical(results, name):
    assert result(results, name)["equal"]


def test_smollm2_gguf_native_at_tp3(results):
    r = result(results, "smollm2_gguf_native_tp3")
    assert r["equal"]
    assert r["max_logprob_diff"] < 1e-4  # f32; the row-parallel sums run in another order


def test_weights_built_at_load_stay_on_the_host_until_placed(results):
    """Quantizing at load, GGUF-native import and dummy weights never build a whole tensor on a
    mesh device (the default device here is one): they are built on the host, and each device
    then receives only its slice."""
    r = result(results, "staged_load_tp2")
    for name in ("int4_rtn", "int8", "dummy", "gguf_native", "hf_int4_rtn"):
        assert r[name] == [r["host"]], (name, r[name])


@pytest.mark.parametrize("name", ["lora_tp2", "lora_int8_tp2", "lora_tp4"])
def test_lora_adapters_under_tensor_parallelism(results, name):
    """A batch mixing two LoRA adapters and none at TP 2 gives the one-device tokens, over float
    and INT8 base weights, and at TP 4, above the model's 2 KV heads (the adapters' wk / wv
    columns replicated as the weights' are); each adapted row's tokens differ from the base
    model's."""
    r = result(results, name)
    assert r["equal"] and r["adapters_change_tokens"]
    # each factor splits with its base weight: wq (column) its b's outputs, wo (row) its a's inputs
    part = 1 / (4 if name == "lora_tp4" else 2)
    assert r["shard"] == {"wq.a": 1.0, "wq.b": part, "wo.a": part, "wo.b": 1.0}
