"""GGUF files written from the tiny golden HF checkpoints the way llama.cpp's convert_hf_to_gguf.py
writes them (tests/loading/test_gguf_archs.py has the details checked against HF), for the tests
that need a GGUF of a golden model: the loaders' and the many-process loading tests."""

from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
from gguf.quants import quantize
from model_testing import GOLDEN_DIR
from safetensors.numpy import load_file

Q = gguf.GGMLQuantizationType
GGUF_ARCH = {"qwen3": "qwen3", "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3"}
GGUF_ARCH["qwen3_moe"] = "qwen3moe"


def reference_dir(tmp_path, name: str):
    """The golden HF folder, its config.json set to what llama.cpp's GGUF can express."""
    cfg = json.loads((GOLDEN_DIR / name / "config.json").read_text())
    if cfg["model_type"] in ("gemma2", "gemma3_text"):
        cfg["query_pre_attn_scalar"] = cfg["head_dim"]  # llama.cpp: 1/sqrt(head_dim) below 27B
    if cfg["model_type"] == "gemma3_text":
        cfg["attn_logit_softcapping"] = None  # the converter asserts it (HF ignores it anyway)
    out = tmp_path / name
    out.mkdir()
    (out / "config.json").write_text(json.dumps(cfg))
    shutil.copy(GOLDEN_DIR / name / "model.safetensors", out / "model.safetensors")
    return out


def convert(hf_dir, path, qtype=Q.F32, drop=(), drop_keys=(), extra_keys=None, replace=None):
    """HF folder -> GGUF at `path`, as llama.cpp's converter writes it (see the module docstring).

    qtype: F32, F16 or Q8_0 for the >= 2-D tensors (1-D ones stay F32, as llama.cpp keeps them);
    drop: GGUF tensor names to leave out; drop_keys: metadata keys ({arch}.x) to leave out;
    extra_keys: {key: value} metadata to add (key without the arch prefix); replace: {GGUF
    tensor name: array} written instead of the converted tensor.
    """
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = GGUF_ARCH[cfg["model_type"]]
    n_layer = cfg["num_hidden_layers"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], n_layer)
    rope = cfg.get("rope_parameters") or {}
    full = rope.get("full_attention", rope)
    tensors, experts = {}, {}
    for src, x in load_file(hf_dir / "model.safetensors").items():
        if arch == "gemma2" and src == "lm_head.weight":
            continue  # tied; the converter skips it
        if arch in ("gemma2", "gemma3") and src.endswith("norm.weight"):
            x = x + 1  # Gemma's RMSNorm scales by (1 + w): the converter stores 1 + w
        if ".mlp.experts." in src:  # qwen3moe: stacked into [E, out, in] per layer and weight
            i, e, w = src.split(".")[2], int(src.split(".")[5]), src.split(".")[6]
            experts.setdefault((int(i), w), {})[e] = x
            continue
        new = names.get_name(src, try_suffixes=(".weight", ".bias"))
        if new is None and arch == "qwen3moe" and ".mlp." in src:
            # a dense layer (mlp_only_layers): llama.cpp has no name for it; jaxserve reads these
            new = "blk.{}.ffn_{}.weight".format(
                src.split(".")[2], src.split(".")[4][: -len("_proj")]
            )
        assert new is not None, src
        tensors[new] = x
    for (i, w), per in experts.items():
        stacked = np.stack([per[e] for e in range(len(per))])
        tensors[names.get_name(f"model.layers.{i}.mlp.experts.{w}.weight", (".weight",))] = stacked
    w = gguf.GGUFWriter(str(path), arch)
    keys = {
        "context_length": (w.add_context_length, cfg["max_position_embeddings"]),
        "embedding_length": (w.add_embedding_length, cfg["hidden_size"]),
        "block_count": (w.add_block_count, n_layer),
        "feed_forward_length": (w.add_feed_forward_length, cfg["intermediate_size"]),
        "attention.head_count": (w.add_head_count, cfg["num_attention_heads"]),
        "attention.head_count_kv": (w.add_head_count_kv, cfg["num_key_value_heads"]),
        "attention.layer_norm_rms_epsilon": (w.add_layer_norm_rms_eps, cfg["rms_norm_eps"]),
    }
    if arch != "gemma2":  # Gemma2Model writes no RoPE base (llama.cpp's default 10000)
        keys["rope.freq_base"] = (w.add_rope_freq_base, full["rope_theta"])
    if "head_dim" in cfg:
        keys["attention.key_length"] = (w.add_key_length, cfg["head_dim"])
        keys["attention.value_length"] = (w.add_value_length, cfg["head_dim"])
    if arch == "gemma2":
        keys["attn_logit_softcapping"] = (
            w.add_attn_logit_softcapping,
            cfg["attn_logit_softcapping"],
        )
        keys["final_logit_softcapping"] = (
            w.add_final_logit_softcapping,
            cfg["final_logit_softcapping"],
        )
        keys["attention.sliding_window"] = (w.add_sliding_window, cfg["sliding_window"])
    if arch == "gemma3":
        if full.get("rope_type") == "linear":
            keys["rope.scaling.type"] = (w.add_rope_scaling_type, gguf.RopeScalingType.LINEAR)
            keys["rope.scaling.factor"] = (w.add_rope_scaling_factor, full["factor"])
        keys["rope.freq_base_swa"] = (
            w.add_rope_freq_base_swa,
            rope["sliding_attention"]["rope_theta"],
        )
        keys["final_logit_softcapping"] = (
            w.add_final_logit_softcapping,
            cfg["final_logit_softcapping"],
        )
        keys["attention.sliding_window"] = (w.add_sliding_window, cfg["sliding_window"])
        # Not written by the converter (llama.cpp's gemma3 assumes a period of 6): the golden's
        # layers [s, s, f, s] as llama.cpp's per-layer bool pattern.
        pattern = [t == "sliding_attention" for t in cfg["layer_types"]]
        keys["attention.sliding_window_pattern"] = (w.add_sliding_window_pattern, pattern)
    if arch == "phi3":
        orig = rope["original_max_position_embeddings"]
        scale = cfg["max_position_embeddings"] / orig
        attn = np.sqrt(1 + np.log(scale) / np.log(orig)) if scale > 1 else 1.0
        keys["rope.scaling.original_context_length"] = (w.add_rope_scaling_orig_ctx_len, orig)
        keys["rope.dimension_count"] = (
            w.add_rope_dimension_count,
            cfg["hidden_size"] // cfg["num_attention_heads"],
        )
        keys["attention.sliding_window"] = (w.add_sliding_window, cfg.get("sliding_window") or 0)
        keys["rope.scaling.attn_factor"] = (w.add_rope_scaling_attn_factors, float(attn))
        tensors["rope_factors_long.weight"] = np.asarray(rope["long_factor"], np.float32)
        tensors["rope_factors_short.weight"] = np.asarray(rope["short_factor"], np.float32)
    tensors.update(replace or {})
    if arch == "qwen3moe":
        keys["expert_count"] = (w.add_expert_count, cfg["num_local_experts"])
        keys["expert_used_count"] = (w.add_expert_used_count, cfg["num_experts_per_tok"])
        keys["expert_feed_forward_length"] = (
            w.add_expert_feed_forward_length,
            cfg["moe_intermediate_size"],
        )
        if not cfg["norm_topk_prob"]:  # llama.cpp renormalizes unless this key says otherwise
            keys["expert_weights_norm"] = (w.add_expert_weights_norm, False)
    for key, (add, value) in keys.items():
        if key not in drop_keys:
            add(value)
    for key, value in (extra_keys or {}).items():
        if isinstance(value, bool):
            w.add_bool(f"{arch}.{key}", value)
        elif isinstance(value, int):
            w.add_uint32(f"{arch}.{key}", value)
        else:
            w.add_float32(f"{arch}.{key}", value)
    w.add_uint32("tokenizer.ggml.bos_token_id", cfg["bos_token_id"])
    w.add_uint32("tokenizer.ggml.eos_token_id", cfg["eos_token_id"])
    for n, x in tensors.items():
        if n in drop:
            continue
        x = np.ascontiguousarray(x, np.float32)
        if x.ndim == 1 or qtype == Q.F32:
            w.add_tensor(n, x)
        elif qtype == Q.F16:
            w.add_tensor(n, x.astype(np.float16))
        else:
            w.add_tensor(n, quantize(x, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
