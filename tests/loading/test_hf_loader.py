"""HF directory loader: logits of tiny random checkpoints against Hugging Face's, and name-map errors."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from model_testing import GOLDEN_DIR, forward_logits, load_golden_logits
from safetensors.numpy import load_file, save_file

from jaxserve.loading import hf, load_model

# f32 vs HF f32 torch on O(1..5) logits: measured max gap 3.3e-6 (accumulation order only).
ATOL = 2e-5


@pytest.mark.parametrize("name", ["llama", "llama31", "mistral", "qwen2"])
def test_logits_match_hf(name):
    config, params = hf.load_hf_dir(GOLDEN_DIR / name, "float32")
    tokens, want = load_golden_logits(name)
    got = forward_logits(params, config, tokens)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


def test_configs_read_from_config_json():
    assert hf.load_hf_config(GOLDEN_DIR / "qwen2").attention_bias
    assert hf.load_hf_config(GOLDEN_DIR / "qwen2").tie_word_embeddings
    rs = hf.load_hf_config(GOLDEN_DIR / "llama31").rope_scaling
    assert rs is not None and rs.factor == 8.0
    assert hf.load_hf_config(GOLDEN_DIR / "mistral").architecture == "mistral"
    # llama31 is sharded: the index maps tensors to several files.
    assert len(set(hf.tensor_files(GOLDEN_DIR / "llama31").values())) > 1


def test_bfloat16_load_is_close_to_float32():
    lm = load_model(str(GOLDEN_DIR / "llama"), dtype="bfloat16")
    assert lm.params["layers"]["wq"].dtype == np.dtype("bfloat16")
    assert lm.tokenizer is None  # the golden directories have no tokenizer files
    tokens, want = load_golden_logits("llama")
    got = forward_logits(lm.params, lm.config, tokens)
    assert np.abs(got - want).max() < 0.25


@pytest.fixture
def model_copy(tmp_path):
    """A writable copy of the tiny llama checkpoint: (dir, tensors dict)."""
    d = tmp_path / "llama"
    shutil.copytree(GOLDEN_DIR / "llama", d)
    return d, load_file(d / "model.safetensors")


def test_missing_tensor_is_named(model_copy):
    d, tensors = model_copy
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensor.*model\.layers\.1\.mlp\.up_proj\.weight"):
        hf.load_hf_dir(d)


def test_unexpected_tensor_is_named(model_copy):
    d, tensors = model_copy
    tensors["model.layers.0.self_attn.extra.weight"] = np.zeros((4, 4), np.float32)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.zeros((8,), np.float32)  # ignored
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"unexpected tensor.*self_attn\.extra\.weight"):
        hf.load_hf_dir(d)


def test_shape_mismatch_is_named(model_copy):
    d, tensors = model_copy
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, 64), np.float32)
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"k_proj\.weight has shape \(16, 64\), expected \(32, 64\)"
    ):
        hf.load_hf_dir(d)


def test_unknown_architecture_is_named(model_copy):
    d, _ = model_copy
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"unknown architecture.*'gpt2'"):
        hf.load_hf_dir(d)


def test_tied_lm_head_copy_is_accepted_only_if_equal(tmp_path):
    d = tmp_path / "qwen2"
    shutil.copytree(GOLDEN_DIR / "qwen2", d)
    tensors = load_file(d / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    save_file(tensors, d / "model.safetensors")
    config, params = hf.load_hf_dir(d)
    assert config.tie_word_embeddings and "lm_head" not in params
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1.0
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"lm_head\.weight differs from model\.embed_tokens"):
        hf.load_hf_dir(d)


def test_fused_phi3_tensors_are_split_and_shape_checked(tmp_path):
    """Phi-3's qkv_proj / gate_up_proj fill wq|wk|wv and w_gate|w_up row by row; a fused tensor
    of the wrong size is named with the size the config implies."""
    d = tmp_path / "phi3"
    shutil.copytree(GOLDEN_DIR / "phi3", d)
    tensors = load_file(d / "model.safetensors")
    config, params = hf.load_hf_dir(d)
    qkv = tensors["model.layers.1.self_attn.qkv_proj.weight"]  # [(H + 2 KVH) * Dh, D]
    q, k = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    np.testing.assert_array_equal(np.asarray(params["layers"]["wk"][1]), qkv[q : q + k].T)
    gate_up = tensors["model.layers.0.mlp.gate_up_proj.weight"]  # [2 I, D]
    np.testing.assert_array_equal(
        np.asarray(params["layers"]["w_up"][0]), gate_up[config.intermediate_size :].T
    )
    tensors["model.layers.0.self_attn.qkv_proj.weight"] = qkv[:-16]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"qkv_proj\.weight has shape \(112, 64\), expected \(128, 64\)"
    ):
        hf.load_hf_dir(d)


def test_gemma_norm_names_map_to_the_sandwich_norms():
    """Gemma's post_attention_layernorm is the attention output's norm (not the MLP input's)."""
    names = hf.hf_tensor_map(hf.load_hf_config(GOLDEN_DIR / "gemma3"))
    assert names["layers/mlp_norm"][0][0] == "model.layers.0.pre_feedforward_layernorm.weight"
    assert names["layers/post_attn_norm"][0][0] == "model.layers.0.post_attention_layernorm.weight"
    assert names["layers/q_norm"][0][3] == "model.layers.3.self_attn.q_norm.weight"
