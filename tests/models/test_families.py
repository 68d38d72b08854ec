"""The dense families of issue 26 against Hugging Face: Qwen3, Gemma 2, Gemma 3 (text), Phi-3
(LongRoPE) and Mistral with its sliding window, from the tiny goldens of
tests/golden/make_goldens.py (each configured so that its features bind: 20-token sequences past
windows of 6, soft-caps of 2 and 4, several layer types, LongRoPE crossing its original length).

Per family: f32 logits vs HF's; cached step-by-step decoding equals the full forward; greedy
tokens equal HF's cached greedy decoding (up to near-ties) through `LLM.generate` on the paged
cache with the CPU's ragged attention, the jnp reference and the Pallas kernels in interpret
mode. Also: config.json parsing of the Hub's formats, the real-scale presets, GGUF llama3 RoPE
(`rope_freqs.weight`), and calibration's dense attention against the paged model.
"""

from __future__ import annotations

import json
import math

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
from jaxserve.config import PRESETS, ModelConfig
from jaxserve.layers import kv_cache as kvc
from jaxserve.layers.norm import rms_norm
from jaxserve.loading import hf, load_model
from jaxserve.loading.params import flat_shapes
from jaxserve.models import llama
from jaxserve.quant import calibration

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

FAMILIES = ["qwen3", "gemma2", "gemma3", "phi3", "mistral_window"]
# f32 vs HF f32 torch on O(1..5) logits, 20 positions, up to 4 layers: measured max gap 1.9e-5
# (gemma3; the others <= 7.6e-6), summation order only.
ATOL = 5e-5
# HF greedy steps whose top-2 logits are closer than this are near-ties: tokens are compared up
# to the first one (the goldens' smallest margin is 1.6e-3, so every step is compared today).
NEAR_TIE = 1e-4


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    name = request.param
    config, params = hf.load_hf_dir(GOLDEN_DIR / name, "float32")
    return name, config, params


def greedy_golden(name: str) -> dict:
    return json.loads((GOLDEN_DIR / name / "greedy.json").read_text())


def test_features_bind_in_the_goldens(family):
    """Each golden exercises what its family adds (else the logits test would prove little)."""
    name, c, _ = family
    tokens, _ = load_golden_logits(name)
    if c.uses_sliding_window:
        assert tokens.shape[1] > 2 * c.sliding_window
    want = {
        "qwen3": lambda: c.qk_norm and c.head_dim * c.num_heads != c.hidden_size,
        "gemma2": lambda: (
            c.attn_logit_softcap
            and c.final_logit_softcap
            and c.sandwich_norms
            and set(c.layer_windows().tolist()) == {0, 6}
            and c.attention_scale != c.head_dim**-0.5
        ),
        "gemma3": lambda: (
            c.qk_norm
            and c.rope_local_theta
            and c.rope_scaling.rope_type == "linear"
            and c.final_logit_softcap
            and list(c.layer_windows()) == [6, 6, 0, 6]
        ),
        "phi3": lambda: (
            c.rope_scaling.rope_type == "longrope" and c.rope_scaling.attention_factor > 1.0
        ),
        "mistral_window": lambda: list(c.layer_windows()) == [6, 6],
    }[name]
    assert want()


def test_logits_match_hf(family):
    name, config, params = family
    tokens, want = load_golden_logits(name)
    np.testing.assert_allclose(forward_logits(params, config, tokens), want, atol=ATOL, rtol=0)


def test_stepwise_decode_equals_full_forward(family):
    """A 5-token prefill then one token per step over scattered pages of 4 (so windows of 6
    slide across page boundaries), against the full 20-token forward."""
    _, config, params = family
    tokens, _ = load_golden_logits("gemma2")  # i32[2, 20], in every family's vocabulary
    b, t = tokens.shape
    full = forward_logits(params, config, tokens)
    ps, prefix, per_seq = 4, 5, 6
    pages = [[5, 0, 7, 2, 11, 9], [1, 6, 3, 4, 10, 8]]
    cache = kvc.init(
        config.num_layers,
        config.num_kv_heads,
        b * per_seq,
        ps,
        config.head_dim,
        "auto",
        jnp.float32,
    )
    meta = sequence_meta(pages, [0] * b, [prefix] * b, prefix, ps, per_seq)
    logits, cache = model_step(params, jnp.asarray(tokens[:, :prefix]), meta, cache, config)
    steps = [np.asarray(logits)]
    for pos in range(prefix, t):
        meta = sequence_meta(pages, [pos] * b, [1] * b, 1, ps, per_seq)
        logits, cache = model_step(
            params, jnp.asarray(tokens[:, pos : pos + 1]), meta, cache, config
        )
        steps.append(np.asarray(logits))
    # f32 summation order (decode vs prefill attention): measured max 1.1e-5 (gemma3, 4 layers).
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=3e-5, rtol=0)


def agree_up_to_near_tie(got: list[int], record: dict) -> None:
    want, margins = record["token_ids"], record["top2_margin"]
    n = next((i for i, m in enumerate(margins) if m < NEAR_TIE), len(want))
    assert got[: n + 1] == want[: n + 1], (got, want, n)


# An engine per (family, implementation): ~20 s of CPU each. Every family runs the CPU default
# (the C++ decode kernel, 'cpu_kernel'); the other implementations run on the families whose
# attention differs for them (gemma2: soft-cap + alternating windows; mistral_window: a window on
# every layer). The kernels themselves are checked against the reference over every option in
# tests/pallas_kernels and tests/cpu_kernels.
ENGINE_CASES = [(f, "cpu_kernel") for f in FAMILIES] + [
    ("gemma2", "ragged"),
    ("mistral_window", "ragged"),
    ("gemma2", "reference"),
    ("gemma2", "pallas_interpret"),
    ("mistral_window", "pallas_interpret"),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, attention_impl", ENGINE_CASES)
def test_llm_generate_greedy_equals_hf(name, attention_impl):
    """The engine (paged cache of 4-token pages, 8-token prefill chunks: chunks and pages both
    straddle the windows) decodes HF's greedy tokens, whatever the attention implementation."""
    golden = greedy_golden(name)
    llm = LLM(
        str(GOLDEN_DIR / name),
        dtype="float32",
        num_slots=4,
        max_model_len=32,
        page_size=4,
        prefill_chunk_size=8,
        max_num_batched_tokens=16,
        attention_impl=attention_impl,
    )
    sp = SamplingParams(temperature=0, max_tokens=golden["new_tokens"], ignore_eos=True)
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in golden["prompts"]]
    outs = llm.generate(prompts, sp, use_tqdm=False)
    for out, record in zip(outs, golden["prompts"]):
        agree_up_to_near_tie(list(out.outputs[0].token_ids), record)


def test_phi3_greedy_crosses_into_the_long_factors():
    """The phi3 greedy runs pass original_max_position_embeddings (16): HF's cached decoding then
    ropes each new position with the long factors, as jaxserve does per position."""
    golden = greedy_golden("phi3")
    c = hf.load_hf_config(GOLDEN_DIR / "phi3")
    longest = max(len(r["prompt_token_ids"]) for r in golden["prompts"]) + golden["new_tokens"]
    assert c.rope_long_from == 16 < longest
    assert not np.allclose(c.inv_freq(), c.inv_freq(long=True))


# --- config.json parsing of the released checkpoints' formats -------------------------------


def test_gemma3_hub_config_format():
    """google/gemma-3-12b-it's text_config keys (flat rope_theta / rope_local_base_freq /
    rope_scaling, sliding_window_pattern instead of layer_types) read like the saved format."""
    hub = {
        "model_type": "gemma3_text",
        "vocab_size": 262208,
        "hidden_size": 3840,
        "intermediate_size": 15360,
        "num_hidden_layers": 48,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
        "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 131072,
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "bos_token_id": 2,
        "eos_token_id": [1, 106],
        "tie_word_embeddings": True,
    }
    c = ModelConfig.from_hf(hub, name="gemma3-12b")
    assert c == PRESETS["gemma3-12b"]
    saved = json.loads((GOLDEN_DIR / "gemma3" / "config.json").read_text())
    flat = {k: v for k, v in saved.items() if k not in ("rope_parameters", "layer_types")}
    flat |= {
        "rope_theta": 10000.0,
        "rope_local_base_freq": 100.0,
        "rope_scaling": {"rope_type": "linear", "factor": 4.0},
        "sliding_window_pattern": 3,
    }
    want = hf.load_hf_config(GOLDEN_DIR / "gemma3")
    assert ModelConfig.from_hf(flat, name="gemma3").layer_windows().tolist() == [6, 6, 0, 6]
    assert ModelConfig.from_hf(flat, name="gemma3") == want


def test_gemma2_and_phi3_and_qwen3_hub_configs_match_presets():
    gemma2 = {
        "model_type": "gemma2",
        "vocab_size": 256000,
        "hidden_size": 3584,
        "intermediate_size": 14336,
        "num_hidden_layers": 42,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
        "query_pre_attn_scalar": 256,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 8192,
        "bos_token_id": 2,
        "eos_token_id": [1, 107],
    }
    phi3 = {
        "model_type": "phi3",
        "vocab_size": 32064,
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "sliding_window": 2047,
        "original_max_position_embeddings": 4096,
        "max_position_embeddings": 4096,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "bos_token_id": 1,
        "eos_token_id": [32000, 32007],
        "tie_word_embeddings": False,
    }
    qwen3 = {
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "use_sliding_window": False,
        "max_window_layers": 36,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "bos_token_id": None,
        "eos_token_id": [151645, 151643],
        "tie_word_embeddings": False,
    }
    for hub, name in ((gemma2, "gemma2-9b"), (phi3, "phi3-mini"), (qwen3, "qwen3-8b")):
        assert ModelConfig.from_hf(hub, name=name) == PRESETS[name], name


def test_phi3_longrope_config_as_hf_computes_it():
    """Phi-3-mini-128k's form: rope_scaling {type: longrope (or the legacy 'su')}, the original
    length at top level, attention factor sqrt(1 + ln(128k / 4k) / ln 4k) unless given."""
    base = json.loads((GOLDEN_DIR / "phi3" / "config.json").read_text())
    rp = base.pop("rope_parameters")
    half = 8
    for kind in ("longrope", "su"):
        hub = base | {
            "rope_theta": 10000.0,
            "rope_scaling": {
                "type": kind,
                "short_factor": rp["short_factor"],
                "long_factor": rp["long_factor"],
            },
            "original_max_position_embeddings": 16,
            "max_position_embeddings": 256,
        }
        c = ModelConfig.from_hf(hub)
        assert c.rope_scaling.rope_type == "longrope" and c.rope_long_from == 16
        assert math.isclose(c.rope_attention_factor, math.sqrt(1 + math.log(16) / math.log(16)))
        assert c == ModelConfig.from_hf(base | {"rope_parameters": rp})
    base_inv = 1 / (10000.0 ** (np.arange(0, 2 * half, 2) / (2 * half)))
    np.testing.assert_allclose(c.inv_freq(long=True), base_inv / rp["long_factor"], rtol=1e-6)
    hub["rope_scaling"] |= {"short_factor": [1.0] * (half - 1), "long_factor": [1.0] * (half - 1)}
    with pytest.raises(ValueError, match=r"factors per frequency"):
        ModelConfig.from_hf(hub)
    hub["rope_scaling"] |= {
        "short_factor": rp["short_factor"],
        "long_factor": rp["long_factor"],
        "partial_rotary_factor": 0.75,
    }
    with pytest.raises(ValueError, match=r"partial_rotary_factor"):
        ModelConfig.from_hf(hub)


def test_sliding_window_rules():
    """Mistral keeps its max_position_embeddings (no clamp to the window any more) and slides on
    every layer; Qwen2/3 slide only with use_sliding_window, from max_window_layers on."""
    mistral = json.loads((GOLDEN_DIR / "mistral_window" / "config.json").read_text())
    c = ModelConfig.from_hf(mistral)
    assert c.max_position_embeddings == 256 and c.sliding_window == 6
    assert c.layer_types is None and c.layer_windows().tolist() == [6, 6]
    qwen = json.loads((GOLDEN_DIR / "qwen3" / "config.json").read_text())
    qwen.pop("layer_types")
    assert not ModelConfig.from_hf(qwen | {"sliding_window": 6}).uses_sliding_window
    on = qwen | {"sliding_window": 6, "use_sliding_window": True, "max_window_layers": 1}
    assert ModelConfig.from_hf(on).layer_windows().tolist() == [0, 6]
    with pytest.raises(ValueError, match=r"layer_types"):
        ModelConfig.from_hf(mistral | {"layer_types": ["sliding_attention"]})
    # A config survives a JSON round trip (the orbax checkpoint's config.json).
    g3 = hf.load_hf_config(GOLDEN_DIR / "gemma3")
    from jaxserve.loading.checkpoint import config_from_dict, config_to_dict

    back = config_from_dict(json.loads(json.dumps(config_to_dict(g3))))
    assert (back.layer_types, back.rope_scaling) == (g3.layer_types, g3.rope_scaling)
    assert hash(back.layer_types) == hash(g3.layer_types)


# --- presets at real scale ------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, billions",
    [("qwen3-8b", 8.19), ("gemma2-9b", 9.24), ("gemma3-12b", 11.77), ("phi3-mini", 3.82)],
)
def test_presets_have_the_released_parameter_counts(name, billions):
    c = ModelConfig.preset(name)
    n = sum(math.prod(s) for s in flat_shapes(c).values())
    assert abs(n / 1e9 - billions) < 0.01 * billions, n


# --- GGUF: Llama 3.1's RoPE scaling as llama.cpp stores it ----------------------------------


def llama3_rope_freqs(cfg: dict) -> np.ndarray:
    """The `rope_freqs.weight` llama.cpp's convert_hf_to_gguf.py writes for `rope_type: llama3`."""
    rp = cfg["rope_parameters"]
    dim = cfg["head_dim"]
    freqs = 1.0 / (rp["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    old, lo, hi = (
        rp["original_max_position_embeddings"],
        rp["low_freq_factor"],
        rp["high_freq_factor"],
    )
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(rp["factor"])
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / rp["factor"] + smooth))
    return np.asarray(out, np.float32)


def test_gguf_rope_freqs_matches_hf_llama31(tmp_path, monkeypatch):
    """The llama31 golden (factor 8, original length 32) converted to GGUF with its
    rope_freqs.weight loads as per-frequency divisors and reproduces HF's logits."""
    import loading.test_gguf_loader as gguf_tests
    from safetensors.numpy import load_file, save_file

    # write_gguf reads <golden>/<name>/model.safetensors: give it llama31's shards as one file.
    golden = tmp_path / "golden"
    (golden / "llama31").mkdir(parents=True)
    (golden / "llama31" / "config.json").write_text(
        (GOLDEN_DIR / "llama31" / "config.json").read_text()
    )
    tensors = {}
    for f in sorted((GOLDEN_DIR / "llama31").glob("*.safetensors")):
        tensors |= load_file(f)
    save_file(tensors, golden / "llama31" / "model.safetensors")
    monkeypatch.setattr(gguf_tests, "GOLDEN_DIR", golden)
    cfg = json.loads((GOLDEN_DIR / "llama31" / "config.json").read_text())
    path = tmp_path / "llama31.gguf"
    gguf_tests.write_gguf(path, "llama31", extra={"rope_freqs.weight": llama3_rope_freqs(cfg)})

    lm = load_model(str(path))
    rs = lm.config.rope_scaling
    assert rs.rope_type == "freq_factors" and max(rs.freq_factors) == 8.0
    want_inv = hf.load_hf_config(GOLDEN_DIR / "llama31").inv_freq()
    np.testing.assert_allclose(lm.config.inv_freq(), want_inv, rtol=1e-6)
    tokens, want = load_golden_logits("llama31")
    np.testing.assert_allclose(forward_logits(lm.params, lm.config, tokens), want, atol=2e-5)


# --- calibration (AWQ / GPTQ statistics) runs the same layers ---------------------------------


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_calibration_layer_forward_matches_the_paged_model(name):
    """Calibration's dense attention honours the windows, soft-cap, scale and per-layer RoPE:
    its layer-by-layer run over a 20-token window gives the paged model's logits."""
    config, params = hf.load_hf_dir(GOLDEN_DIR / name, "float32")
    tokens, _ = load_golden_logits(name)
    x = calibration._embed(params, tokens, config)
    for i in range(config.num_layers):
        x, _ = calibration.layer_forward(calibration.layer_slice(params, i), x, config, i)
    hidden = rms_norm(x, params["final_norm"], config.rms_norm_eps, config.norm_offset)
    got = np.asarray(llama.compute_logits(params, hidden, config))
    np.testing.assert_allclose(got, forward_logits(params, config, tokens), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"per layer"):
        calibration.layer_forward(calibration.layer_slice(params, 0), x, config)
