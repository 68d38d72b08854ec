"""GGUF loader on small files written here with gguf.GGUFWriter the way llama.cpp's converter does.

The tiny golden HF checkpoints are converted to GGUF (llama: q/k rows permuted; qwen2: biases,
tied output) and must reproduce Hugging Face's logits; corrupted files must fail with errors
naming the tensor. The real SmolLM2 GGUF is tested in tests/models/test_smollm2.py.
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
from model_testing import GOLDEN_DIR, forward_logits, load_golden_logits
from safetensors.numpy import load_file

from jaxserve.loading import gguf_file, hf, load_model

Q = gguf.GGMLQuantizationType


def write_gguf(path, name: str, drop=(), extra=None, raw=None, arch=None) -> None:
    """Converts tests/golden/<name> to GGUF at `path` (F32 tensors, llama.cpp names and layout).

    drop: GGUF tensor names to leave out; extra: {name: array} to add; raw: {name: (bytes, type)}
    replacing a tensor's data with raw blocks of a quantized type; arch: override the architecture.
    """
    cfg = json.loads((GOLDEN_DIR / name / "config.json").read_text())
    arch = arch or {"llama": "llama", "qwen2": "qwen2"}[cfg["model_type"]]
    hf_tensors = load_file(GOLDEN_DIR / name / "model.safetensors")
    tensors = {}
    for key, (suffix, _) in hf.LAYER_NAMES.items():
        for i in range(cfg["num_hidden_layers"]):
            src = f"model.layers.{i}.{suffix}"
            if src in hf_tensors:
                x = hf_tensors[src]
                if arch == "llama" and key in ("wq", "wk"):
                    heads = cfg["num_attention_heads" if key == "wq" else "num_key_value_heads"]
                    x = gguf_file.permute_rows(x, heads)
                tensors[f"blk.{i}.{gguf_file.LAYER_NAMES[key]}"] = x
    for key, (src, _) in hf.GLOBAL_NAMES.items():
        if src in hf_tensors:
            tensors[gguf_file.GLOBAL_NAMES[key]] = hf_tensors[src]
    tensors.update(extra or {})
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    for n, x in tensors.items():
        if n in drop:
            continue
        if raw and n in raw:
            w.add_tensor(n, raw[n][0], raw_dtype=raw[n][1])
        else:
            w.add_tensor(n, np.ascontiguousarray(x, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_converted_gguf_matches_hf_logits(tmp_path, name):
    path = tmp_path / f"{name}.gguf"
    write_gguf(path, name)
    lm = load_model(str(path))
    assert lm.tokenizer is None  # no tokenizer.* keys in this file
    assert lm.config.tie_word_embeddings == (name == "qwen2")
    assert lm.config.attention_bias == (name == "qwen2")
    tokens, want = load_golden_logits(name)
    np.testing.assert_allclose(forward_logits(lm.params, lm.config, tokens), want, atol=2e-5)


def test_permutation_roundtrip():
    w = np.arange(6 * 16 * 3, dtype=np.float32).reshape(6 * 16, 3)
    p = gguf_file.permute_rows(w, 6)
    assert not np.array_equal(p, w)
    np.testing.assert_array_equal(gguf_file.unpermute_rows(p, 6), w)
    # Raw quantized rows (bytes) move the same way.
    b = np.arange(96 * 20, dtype=np.uint8).reshape(96, 20)
    np.testing.assert_array_equal(gguf_file.unpermute_rows(gguf_file.permute_rows(b, 3), 3), b)


def test_tensor_map_lists_layers_in_order(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama")
    reader = gguf_file.open_gguf(path)
    config = gguf_file.config_from_gguf(reader)
    tmap = gguf_file.gguf_tensor_map(reader, config)
    assert [t.name for t in tmap["layers/wk"]] == ["blk.0.attn_k.weight", "blk.1.attn_k.weight"]
    assert [t.name for t in tmap["lm_head"]] == ["output.weight"]
    assert gguf_file.unpermute_heads("layers/wk", config) == 2
    assert gguf_file.unpermute_heads("layers/wv", config) is None


def test_unsupported_tensor_type_is_named(tmp_path):
    path = tmp_path / "m.gguf"
    # IQ4_NL: 32 weights in 18 bytes; attn_v is [64 in, 32 out] -> 32 rows of 2 blocks.
    raw = {"blk.1.attn_v.weight": (np.zeros((32, 36), np.uint8), Q.IQ4_NL)}
    write_gguf(path, "llama", raw=raw)
    with pytest.raises(ValueError, match=r"blk\.1\.attn_v\.weight has unsupported type IQ4_NL"):
        load_model(str(path))


def test_missing_tensor_is_named(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", drop={"blk.1.ffn_up.weight"})
    with pytest.raises(ValueError, match=r"missing tensor blk\.1\.ffn_up\.weight"):
        load_model(str(path))


def test_unexpected_tensor_is_named(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", extra={"blk.0.attn_extra.weight": np.zeros((4, 4), np.float32)})
    with pytest.raises(ValueError, match=r"unexpected tensor.*blk\.0\.attn_extra\.weight"):
        load_model(str(path))


def test_shape_mismatch_is_named(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", extra={"blk.0.ffn_down.weight": np.zeros((64, 64), np.float32)})
    with pytest.raises(
        ValueError, match=r"blk\.0\.ffn_down\.weight has shape \[64, 64\], expected \[128, 64\]"
    ):
        load_model(str(path))


def test_unknown_architecture_is_named(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", arch="gpt2")
    with pytest.raises(ValueError, match=r"unknown architecture.*'gpt2'"):
        load_model(str(path))
