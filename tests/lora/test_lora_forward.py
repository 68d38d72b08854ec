"""The model's forward with a LoRA adapter in its slot equals the float model with the adapter
merged into its weights, W + scale * B @ A (merged here, by the test, from the PEFT folder's own
tensors): over quantized base weights (INT4-RTN, INT8, FP8: W their dequantized values) on the
golden Llama, and on SmolLM2-135M (f32, every projection of its 30 layers)."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from lora_testing import write_adapter
from model_testing import GOLDEN_DIR, forward_logits, load_golden_logits, sequence_meta

from jaxserve.layers import kv_cache as kvc
from jaxserve.layers import lora as lora_layers
from jaxserve.layers.embedding import is_quantized
from jaxserve.loading import load_model
from jaxserve.lora import LoRARequest
from jaxserve.lora.peft import read_adapter
from jaxserve.models import llama
from jaxserve.quant import quantize_params

BASE = GOLDEN_DIR / "llama"


@functools.partial(jax.jit, static_argnames=("config",))
def adapted_logits(params, tokens, meta, config, rows):
    c = config
    pages = meta.page_table.size
    cache = kvc.init(c.num_layers, c.num_kv_heads, pages, 8, c.head_dim, "auto", jnp.float32)
    hidden, _ = llama.forward(params, tokens, meta, cache, config, lora_rows=rows)
    return llama.compute_logits(params, hidden, config)


def with_adapter(params, config, adapter, tokens, slot_of_row):
    """Logits [B, T, V] of `params` with `adapter` in slot 1 of 2 (rank 16), row b using slot
    slot_of_row[b] (-1: none)."""
    stacks = lora_layers.init(config, 2, 16, jnp.float32)
    stacks = lora_layers.set_slot(
        stacks, 1, lora_layers.slot_arrays(adapter, config, 16, np.float32)
    )
    b, t = tokens.shape
    per_seq = -(-t // 8)
    meta = sequence_meta([list(range(i * per_seq, (i + 1) * per_seq)) for i in range(b)],
                         [0] * b, [t] * b, t, 8, per_seq)  # fmt: skip
    rows = jnp.asarray(slot_of_row, jnp.int32)
    params = {**params, "lora": stacks}
    return np.asarray(adapted_logits(params, jnp.asarray(tokens), meta, config, rows))


@pytest.mark.parametrize("method", ["int4-rtn", "int8", "fp8"])
def test_an_adapter_over_quantized_weights_equals_it_merged_into_their_values(method, tmp_path):
    loaded = load_model(str(BASE), dtype="float32")
    config = loaded.config
    quantized = quantize_params(loaded.params, config, method, group_size=32)
    path = write_adapter(tmp_path / "a", BASE, rank=4, seed=3)
    adapter = read_adapter(LoRARequest("a", 1, str(path)), config, max_lora_rank=8)
    tokens, _ = load_golden_logits("llama")
    got = with_adapter(quantized, config, adapter, tokens, [1, 1])

    def merged(name, w):
        w = w.dequantize() if is_quantized(w) else w
        if name in adapter.weights:
            a, bb = adapter.weights[name]
            w = w + np.einsum("lir,lro->lio", a, bb)
        return w

    layers = {n: merged(n, w) for n, w in quantized["layers"].items()}
    embed = quantized["embed"]
    params = {**quantized, "layers": layers}
    if is_quantized(embed):
        params["embed"] = embed.dequantize().T  # the lm_head view [D, V] back to the table
    if "lm_head" in params and is_quantized(params["lm_head"]):
        params["lm_head"] = params["lm_head"].dequantize()
    want = forward_logits(params, config, tokens)
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=0)
    plain = with_adapter(quantized, config, adapter, tokens, [-1, -1])
    assert np.abs(plain - want).max() > 1e-2  # the adapter changes the logits


@pytest.mark.smollm2
def test_smollm2_with_an_adapter_equals_it_merged(smollm2_f32, tmp_path):
    """SmolLM2-135M in f32, an adapter of rank 16 on all seven projections of its 30 layers; one
    row with it and one without, in one batch."""
    c = smollm2_f32.config
    base = tmp_path / "base"  # a config.json of SmolLM2's shapes, for the adapter writer
    base.mkdir()
    hf = {"hidden_size": c.hidden_size, "num_attention_heads": c.num_heads,
          "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
          "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers}  # fmt: skip
    (base / "config.json").write_text(json.dumps(hf))
    path = write_adapter(tmp_path / "a", base, rank=16, alpha=32, seed=5, size=0.5)
    adapter = read_adapter(LoRARequest("a", 1, str(path)), c, max_lora_rank=16)
    tok = smollm2_f32.tokenizer
    ids = [tok.encode("The capital of France is Paris, and the capital of Italy is")[:12]] * 2
    tokens = np.asarray(ids, np.int32)
    got = with_adapter(smollm2_f32.params, c, adapter, tokens, [1, -1])
    layers = dict(smollm2_f32.params["layers"])
    for name, (a, bb) in adapter.weights.items():
        layers[name] = layers[name] + np.einsum("lir,lro->lio", a, bb)
    want = forward_logits({**smollm2_f32.params, "layers": layers}, c, tokens[:1])[0]
    base_logits = forward_logits(smollm2_f32.params, c, tokens[1:])[0]
    np.testing.assert_allclose(got[0], want, atol=1e-3, rtol=0)
    np.testing.assert_allclose(got[1], base_logits, atol=1e-3, rtol=0)
    assert np.abs(want - base_logits).max() > 0.1  # the adapter changes the logits
