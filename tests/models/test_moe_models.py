"""Mixture-of-experts models (Mixtral, Qwen3-MoE) against Hugging Face's: f32 logits, cached
step-by-step decoding equals the full forward, greedy tokens through `LLM.generate`, quantized
experts, and no recompilation when the routing changes."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_testing import (
    GOLDEN_DIR,
    forward_logits,
    load_golden_logits,
    model_step,
    sequence_meta,
)

from jaxserve import LLM, SamplingParams
from jaxserve.bench.core import CompileCounter
from jaxserve.layers import kv_cache as kvc
from jaxserve.loading import hf
from jaxserve.quant import QUANTIZED_TYPES, linear_weight_names, quantize_params, replace_weights

NAMES = ["mixtral", "qwen3_moe", "qwen3_moe_sparse2"]
# f32 vs HF f32 torch on O(1..4) logits: measured max gap 2.9e-6 (Mixtral), 2.6e-6 (Qwen3-MoE),
# accumulation order only.
ATOL = 2e-5
NEAR_TIE = 1e-3  # greedy tokens are compared up to HF's first top-2 margin below this


def load(name):
    return hf.load_hf_dir(GOLDEN_DIR / name, "float32")


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_hf(name):
    config, params = load(name)
    assert config.num_experts > 0 and config.moe_layers
    tokens, want = load_golden_logits(name)
    np.testing.assert_allclose(forward_logits(params, config, tokens), want, atol=ATOL, rtol=0)


def test_configs_read_from_config_json():
    mix = hf.load_hf_config(GOLDEN_DIR / "mixtral")
    assert (mix.num_experts, mix.num_experts_per_tok, mix.norm_topk_prob) == (8, 2, True)
    assert mix.moe_layers == (0, 1) and mix.dense_layers == ()
    q = hf.load_hf_config(GOLDEN_DIR / "qwen3_moe")
    assert (q.num_experts, q.num_experts_per_tok, q.norm_topk_prob) == (16, 4, False)
    assert (q.moe_intermediate_size, q.intermediate_size) == (32, 128)
    assert q.mlp_only_layers == (2,) and q.moe_layers == (0, 1, 3) and q.dense_layers == (2,)
    q2 = hf.load_hf_config(GOLDEN_DIR / "qwen3_moe_sparse2")
    assert q2.decoder_sparse_step == 2 and q2.moe_layers == (1,) and q2.norm_topk_prob


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_stepwise_decode_equals_full_forward(name):
    config, params = load(name)
    tokens, _ = load_golden_logits(name)  # i32[2, 12]
    b, t = tokens.shape
    full = forward_logits(params, config, tokens)
    ps, prefix, per_seq = 4, 5, 4
    pages = [[5, 0, 7, 2], [1, 6, 3, 4]]
    cache = kvc.init(
        config.num_layers, config.num_kv_heads, b * per_seq, ps, config.head_dim, "auto",
        jnp.float32,
    )  # fmt: skip
    meta = sequence_meta(pages, [0] * b, [prefix] * b, prefix, ps, per_seq)
    logits, cache = model_step(params, jnp.asarray(tokens[:, :prefix]), meta, cache, config)
    steps = [np.asarray(logits)]
    with CompileCounter() as counter:
        for pos in range(prefix, t):  # crosses page boundaries at 8
            if pos == prefix + 1:
                counter.count = 0  # the decode shape has compiled; no routing may recompile it
            meta = sequence_meta(pages, [pos] * b, [1] * b, 1, ps, per_seq)
            logits, cache = model_step(
                params, jnp.asarray(tokens[:, pos : pos + 1]), meta, cache, config
            )
            steps.append(np.asarray(logits))
    assert counter.count == 0
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-5, rtol=0)


def hf_greedy(name):
    return json.loads((GOLDEN_DIR / name / "greedy.json").read_text())["prompts"]


def agreed_prefix(ours, record):
    """How many of our tokens must equal HF's: up to (and including) HF's first near-tie."""
    for i, m in enumerate(record["top2_margin"]):
        if m < NEAR_TIE:
            return i + 1 if ours[:i] == record["token_ids"][:i] else 0
    return len(record["token_ids"])


@pytest.mark.parametrize("name", NAMES)
def test_greedy_generate_matches_hf(name):
    records = hf_greedy(name)
    llm = LLM(
        str(GOLDEN_DIR / name),
        dtype="float32",
        num_slots=4,
        max_model_len=64,
        page_size=8,
        prefill_chunk_size=8,  # the 9-token prompt takes two chunks
        max_num_batched_tokens=16,
    )
    n = len(records[0]["token_ids"])
    outs = llm.generate(
        [{"prompt_token_ids": r["prompt_token_ids"]} for r in records],
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
        use_tqdm=False,
    )
    for out, record in zip(outs, records):
        ours = list(out.outputs[0].token_ids)
        k = agreed_prefix(ours, record)
        assert ours[:k] == record["token_ids"][:k], (record["prompt_token_ids"], ours)


@pytest.mark.parametrize("method", ["int8", "int4-rtn"])
def test_quantized_experts_run_as_their_dequantized_weights(method):
    """The MoE layer multiplies a quantized expert stack as exactly its dequantized values."""
    config, params = load("mixtral")
    names = linear_weight_names(params, config)
    assert {"layers/we_gate", "layers/we_up", "layers/we_down"} <= set(names)
    assert "layers/router" not in names  # the router stays float
    q = quantize_params(params, config, method, 32, quantize_embedding=False)
    assert all(isinstance(q["layers"][n], QUANTIZED_TYPES) for n in ("we_gate", "we_up", "we_down"))
    assert q["layers"]["router"].dtype == jnp.float32
    dq = replace_weights(
        q, {n: q["layers"][n.split("/")[1]].dequantize() for n in names if n.startswith("layers/")}
    )
    dq = replace_weights(dq, {"lm_head": q["lm_head"].dequantize()})
    tokens, _ = load_golden_logits("mixtral")
    np.testing.assert_allclose(
        forward_logits(q, config, tokens), forward_logits(dq, config, tokens), atol=2e-5, rtol=0
    )


def test_calibrated_quantization_refuses_moe():
    config, params = load("mixtral")
    with pytest.raises(ValueError, match="does not support mixture-of-experts"):
        quantize_params(params, config, "int4-gptq", 32, calib=object())


def test_expert_stacks_come_from_their_tensors():
    """we_gate[k, e] of the k-th sparse layer is experts.{e}.w1 of that layer, transposed."""
    from safetensors.numpy import load_file

    config, params = hf.load_hf_dir(GOLDEN_DIR / "mixtral", "float32")
    tensors = load_file(GOLDEN_DIR / "mixtral" / "model.safetensors")
    w = tensors["model.layers.1.block_sparse_moe.experts.5.w1.weight"]
    np.testing.assert_array_equal(np.asarray(params["layers"]["we_gate"][1, 5]), w.T)
    r = tensors["model.layers.0.block_sparse_moe.gate.weight"]
    np.testing.assert_array_equal(np.asarray(params["layers"]["router"][0]), r.T)
    assert jax.tree.leaves(params["layers"]["we_down"])[0].shape == (2, 8, 96, 64)


def test_missing_expert_tensor_is_named(tmp_path):
    import shutil

    from safetensors.numpy import load_file, save_file

    d = tmp_path / "mixtral"
    shutil.copytree(GOLDEN_DIR / "mixtral", d)
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.7.w2.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"missing tensor.*layers\.1\.block_sparse_moe\.experts\.7\.w2"
    ):
        hf.load_hf_dir(d)


@pytest.mark.parametrize(
    "fields,message",
    [
        (
            dict(num_experts_per_tok=9),
            r"num_experts_per_tok = 9 is implausibly large \(at most 8\)",
        ),
        (dict(moe_intermediate_size=0), r"moe_intermediate_size must be positive"),
        (
            dict(mlp_only_layers=(5,)),
            r"mlp_only_layers must be a tuple of layer indices in \[0, 2\)",
        ),
        (dict(decoder_sparse_step=3), r"decoder_sparse_step = 3 is implausibly large"),
        (dict(num_experts=0), r"architecture 'mixtral' needs num_experts > 0"),
    ],
)
def test_bad_moe_configs_are_named(fields, message):
    import dataclasses

    mix = hf.load_hf_config(GOLDEN_DIR / "mixtral")
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(mix, **fields)


def test_quantized_moe_checkpoint_round_trip(tmp_path):
    """An INT8 Qwen3-MoE saved as a jaxserve checkpoint loads back identical (config fields
    mlp_only_layers etc. included; the recipe check covers the expert stacks)."""
    from jaxserve.loading import checkpoint

    config, params = load("qwen3_moe")  # mixed dense / sparse layers, non-default MoE fields
    q = quantize_params(params, config, "int8", quantize_embedding=False)
    path = checkpoint.save_checkpoint(tmp_path / "ck", config, q, None, {"quantization": "int8"})
    loaded = checkpoint.load_checkpoint(path)
    assert loaded.config == config
    for (pa, a), (pb, b) in zip(
        jax.tree_util.tree_leaves_with_path(q), jax.tree_util.tree_leaves_with_path(loaded.params)
    ):
        assert pa == pb
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
