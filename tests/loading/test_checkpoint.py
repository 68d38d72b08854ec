"""Checkpoints: save -> load gives identical logits (float and INT4); mismatches name the problem."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ptq_testing import tiny_params

from jaxserve.config import ModelConfig
from jaxserve.eval.perplexity import perplexity
from jaxserve.loading import checkpoint
from jaxserve.quant import Int4Weight, quantize_params, with_matmul_impl

CONFIG = ModelConfig.preset("tiny")


def _int4(params, g=32):
    """Every linear, lm_head and the embedding table (lm_head view) as Int4Weight."""
    return quantize_params(params, CONFIG, "int4-rtn", g)


def _nll(params):
    ids = np.arange(64) % CONFIG.vocab_size
    return perplexity(params, CONFIG, ids, window=32, batch=2)["nll"]


@pytest.mark.parametrize("kind", ["float", "int4"])
def test_round_trip_gives_identical_logits(tmp_path, kind):
    params = tiny_params(CONFIG)
    params["layers"]["attn_norm"] = params["layers"]["attn_norm"].astype(
        jnp.bfloat16
    )  # dtypes kept
    recipe = {"quantization": None}
    if kind == "int4":
        params = _int4(params)
        recipe = {"quantization": "int4-rtn", "group_size": 32}
    path = checkpoint.save_checkpoint(tmp_path / "ck", CONFIG, params, None, recipe)
    assert checkpoint.is_checkpoint(path) and not checkpoint.is_checkpoint(tmp_path)
    loaded = checkpoint.load_checkpoint(path)
    assert loaded.config == CONFIG and loaded.tokenizer is None
    assert checkpoint.read_recipe(path)["quantization"] == recipe["quantization"]
    flat = jax.tree_util.tree_leaves_with_path(params)
    got = jax.tree_util.tree_leaves_with_path(loaded.params)
    assert [p for p, _ in flat] == [p for p, _ in got]
    for (p, a), (_, b) in zip(flat, got):
        assert a.dtype == b.dtype, p
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if kind == "int4":
        assert isinstance(loaded.params["layers"]["wq"], Int4Weight)
        assert isinstance(loaded.params["embed"], Int4Weight)
        assert loaded.params["layers"]["wq"].group_size == 32
    assert _nll(loaded.params) == _nll(params)


def test_int4_impl_is_not_restored(tmp_path):
    """The matmul impl is the engine's choice: a checkpoint's (old ones say "auto") is ignored."""
    params = with_matmul_impl(_int4(tiny_params(CONFIG)), "pallas")
    recipe = {"quantization": "int4-rtn", "group_size": 32}
    path = checkpoint.save_checkpoint(tmp_path / "ck", CONFIG, params, None, recipe)
    meta_file = path / checkpoint.META_FILE
    meta = json.loads(meta_file.read_text())
    assert meta["weights"]["layers/wq"]["static"] == {"group_size": 32, "impl": "pallas"}
    for spec in meta["weights"].values():
        spec["static"]["impl"] = "auto"  # as written before impl became a static choice
    meta_file.write_text(json.dumps(meta))
    loaded = checkpoint.load_checkpoint(path)
    assert loaded.params["layers"]["wq"].impl == "xla" and loaded.params["embed"].impl == "xla"


def test_mismatched_recipe_or_shapes_are_errors_naming_the_weight(tmp_path):
    params = _int4(tiny_params(CONFIG))
    with pytest.raises(ValueError, match="recipe says int8 but weight layers/wq is a Int4Weight"):
        checkpoint.save_checkpoint(tmp_path / "a", CONFIG, params, None, {"quantization": "int8"})
    with pytest.raises(ValueError, match="recipe group_size 64 does not match weight layers/wq"):
        checkpoint.save_checkpoint(
            tmp_path / "b", CONFIG, params, None, {"quantization": "int4-awq", "group_size": 64}
        )
    with pytest.raises(ValueError, match="recipe says unquantized but embed is a Int4Weight"):
        checkpoint.save_checkpoint(tmp_path / "c", CONFIG, params, None, None)

    path = checkpoint.save_checkpoint(
        tmp_path / "ok", CONFIG, params, None, {"quantization": "int4-rtn", "group_size": 32}
    )
    with pytest.raises(ValueError, match="already exists"):
        checkpoint.save_checkpoint(path, CONFIG, params, None, None)
    with pytest.raises(ValueError, match="requested quantization 'int4-gptq'.*holds 'int4-rtn'"):
        checkpoint.load_checkpoint(path, quantization="int4-gptq")

    meta_file = path / checkpoint.META_FILE
    meta = json.loads(meta_file.read_text())
    meta["config"]["intermediate_size"] = 96  # the config no longer matches the saved weights
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="layers/w_(gate|up|down)"):
        checkpoint.load_checkpoint(path)

    meta["config"]["intermediate_size"] = CONFIG.intermediate_size
    meta["recipe"]["group_size"] = 64
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="recipe group_size 64 does not match weight"):
        checkpoint.load_checkpoint(path)

    meta["recipe"]["group_size"] = 32
    meta["weights"]["layers/wq"]["static"]["group_size"] = 64
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="Int4Weight.scales has shape"):
        checkpoint.load_checkpoint(path)


def test_int4_groups_that_cannot_split_over_the_devices_are_named_before_restoring():
    """An INT4 checkpoint whose row-parallel groups do not fit a device's rows fails naming the
    weight and the fix, not with orbax's sharding error (found across two processes, issue 58)."""
    weights = {
        "layers/wq": {"type": "Int4Weight", "static": {"group_size": 32}, "shape": [2, 64, 64]},
        "layers/wo": {"type": "Int4Weight", "static": {"group_size": 32}, "shape": [2, 64, 64]},
    }
    checkpoint._check_row_groups(weights, 2)  # 32 rows per device: one group each
    with pytest.raises(
        ValueError,
        match=r"layers/wo: INT4 groups of 32 rows cannot split over "
        r"tensor_parallel_size=4 \(16 input rows per device\)",
    ):
        checkpoint._check_row_groups(weights, 4)
    int8 = {"layers/wo": {"type": "Int8Weight", "static": {}, "shape": [2, 64, 64]}}
    checkpoint._check_row_groups(int8, 4)  # per-channel scales: any split
