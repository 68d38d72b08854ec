"""load_model dispatch: dummy presets and configs, HF directories, bad arguments."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from model_testing import GOLDEN_DIR

from jaxserve.config import ModelConfig
from jaxserve.loading import LoadedModel, load_model
from jaxserve.models import params
from jaxserve.models.llama import check_params


def test_dummy_preset_at_requested_dtype():
    lm = load_model("tiny", dtype="bfloat16", load_format="dummy")
    assert isinstance(lm, LoadedModel)
    assert lm.config == ModelConfig.preset("tiny")
    assert lm.tokenizer is None and lm.source == "dummy:tiny"
    check_params(lm.params, lm.config)
    assert lm.params["layers"]["w_up"].dtype == jnp.bfloat16
    assert float(jnp.std(lm.params["layers"]["w_up"].astype(jnp.float32))) > 0.01


def test_dummy_real_scale_preset_shapes():
    # llama3-8b at real shapes would allocate 32 GB; check the smallest real preset instead.
    lm = load_model(None, dtype="bfloat16", load_format="dummy")
    assert lm.config.name == "smollm2-135m"
    assert lm.params["embed"].shape == (49152, 576)
    # The 28M-element table is drawn in row blocks of DRAW_BLOCK elements (no whole f32 copy):
    # still N(0, 0.02^2) throughout, and each block its own draw.
    table = np.asarray(lm.params["embed"], np.float32)
    block = params.DRAW_BLOCK // 576
    assert table.size > params.DRAW_BLOCK
    assert abs(table.std() - 0.02) < 2e-4 and abs(table.mean()) < 1e-4
    assert abs(table[-1000:].std() - 0.02) < 1e-3  # the clamped last block is drawn too
    assert not np.array_equal(table[:100], table[block : block + 100])


@pytest.mark.parametrize(
    "name, source", [("small-custom", "dummy:small-custom"), ("", "dummy:custom")]
)
def test_dummy_any_model_config(name, source):
    config = dataclasses.replace(ModelConfig.preset("tiny"), num_layers=3, vocab_size=96, name=name)
    lm = load_model(config, dtype="float32", load_format="dummy")
    assert lm.config is config and lm.tokenizer is None and lm.source == source
    check_params(lm.params, config)
    assert lm.params["layers"]["wq"].shape[0] == 3 and lm.params["embed"].shape[0] == 96
    q = load_model(config, load_format="dummy", quantization="int8")
    assert type(q.params["layers"]["wq"]).__name__ == "Int8Weight"


def test_hf_directory():
    lm = load_model(str(GOLDEN_DIR / "mistral"))
    assert lm.config.architecture == "mistral" and lm.tokenizer is None
    assert lm.params["layers"]["wq"].dtype == jnp.float32


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            dict(model="no/such-model"),
            r"model .no/such-model.: .* not in the local Hugging Face cache .* hub is off",
        ),
        (dict(model="llama3-8b"), r"with load_format='dummy' a preset name"),
        (
            dict(model="gpt5", load_format="dummy"),
            r"needs a preset name or a ModelConfig, got 'gpt5'",
        ),
        (
            dict(model=ModelConfig.preset("tiny")),
            r"a ModelConfig as model needs load_format='dummy'",
        ),
        (
            dict(model="tiny", load_format="dummy", quantization="gguf-native"),
            r"reads a GGUF file; load_format must be 'auto'",
        ),
        (dict(model="tiny", load_format="safetensors"), r"load_format must be one of"),
        (dict(model="tiny", dtype="float16", load_format="dummy"), r"dtype must be one of"),
    ],
)
def test_bad_arguments_are_named(kwargs, match, tmp_path, monkeypatch):
    from huggingface_hub import constants  # a repo id is looked up offline, in an empty cache

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match=match):
        load_model(**kwargs)
