"""Reading PEFT adapter folders: the engine's layout, the scale, and every refusal named at load."""

import json
import math

import numpy as np
import pytest
from lora_testing import write_adapter
from model_testing import GOLDEN_DIR
from safetensors.numpy import load_file, save_file

from jaxserve.config import ModelConfig
from jaxserve.loading.hf import load_hf_config
from jaxserve.lora import LoRARequest
from jaxserve.lora.peft import read_adapter, target_dims

BASE = GOLDEN_DIR / "llama"


@pytest.fixture(scope="module")
def config() -> ModelConfig:
    return load_hf_config(BASE)


def request(path, name="a", i=1):
    return LoRARequest(name, i, str(path))


@pytest.mark.parametrize("rslora", [False, True])
def test_layout_and_scale(tmp_path, config, rslora):
    path = write_adapter(tmp_path / "a", BASE, rank=4, alpha=8, rslora=rslora, layers=[1])
    adapter = read_adapter(request(path), config, max_lora_rank=8)
    scale = 8 / math.sqrt(4) if rslora else 8 / 4
    assert adapter.rank == 4 and adapter.scale == pytest.approx(scale)
    assert set(adapter.weights) == set(target_dims(config))
    raw = load_file(str(path / "adapter_model.safetensors"))
    a, b = adapter.weights["wo"]
    key = "base_model.model.model.layers.1.self_attn.o_proj"
    np.testing.assert_array_equal(a[1], raw[f"{key}.lora_A.weight"].T)
    np.testing.assert_allclose(b[1], scale * raw[f"{key}.lora_B.weight"].T, rtol=1e-6)
    assert not a[0].any() and not b[0].any()  # layer 0 has no adapter: zeros
    # x @ a @ b is the merged delta: x @ (scale * B @ A)^T
    x = np.random.default_rng(0).normal(size=(3, a.shape[1]))
    want = x @ (scale * raw[f"{key}.lora_B.weight"] @ raw[f"{key}.lora_A.weight"]).T
    np.testing.assert_allclose(x @ a[1] @ b[1], want, rtol=1e-5, atol=1e-6)


def test_fused_phi3_modules_split_their_b_rows(tmp_path):
    base = GOLDEN_DIR / "phi3"
    cfg = load_hf_config(base)
    hf = json.loads((base / "config.json").read_text())
    dh = hf["hidden_size"] // hf["num_attention_heads"]
    qd, kd = hf["num_attention_heads"] * dh, hf["num_key_value_heads"] * dh
    rng = np.random.default_rng(0)
    d, i = hf["hidden_size"], hf["intermediate_size"]
    key = "base_model.model.model.layers.0"
    tensors = {
        f"{key}.self_attn.qkv_proj.lora_A.weight": rng.normal(size=(2, d)).astype(np.float32),
        f"{key}.self_attn.qkv_proj.lora_B.weight": rng.normal(size=(qd + 2 * kd, 2)).astype(
            np.float32
        ),
        f"{key}.mlp.gate_up_proj.lora_A.weight": rng.normal(size=(2, d)).astype(np.float32),
        f"{key}.mlp.gate_up_proj.lora_B.weight": rng.normal(size=(2 * i, 2)).astype(np.float32),
    }
    out = tmp_path / "phi"
    out.mkdir()
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(
        json.dumps({"r": 2, "lora_alpha": 2, "target_modules": ["qkv_proj", "gate_up_proj"]})
    )
    adapter = read_adapter(request(out), cfg, max_lora_rank=4)
    b = tensors[f"{key}.self_attn.qkv_proj.lora_B.weight"]
    np.testing.assert_array_equal(adapter.weights["wk"][1][0], b[qd : qd + kd].T)
    np.testing.assert_array_equal(adapter.weights["wv"][1][0], b[qd + kd :].T)
    np.testing.assert_array_equal(adapter.weights["wq"][0], adapter.weights["wv"][0])
    up = tensors[f"{key}.mlp.gate_up_proj.lora_B.weight"][i:]
    np.testing.assert_array_equal(adapter.weights["w_up"][1][0], up.T)
    assert "w_down" not in adapter.weights and "wo" not in adapter.weights


def _edit_config(path, **fields):
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg.update(fields)
    (path / "adapter_config.json").write_text(json.dumps(cfg))


def _edit_tensors(path, fn):
    t = load_file(str(path / "adapter_model.safetensors"))
    save_file(fn(t), str(path / "adapter_model.safetensors"))


BAD = {
    "dora": (lambda p: _edit_config(p, use_dora=True), r"DoRA is not supported"),
    "bias": (lambda p: _edit_config(p, bias="all"), r"LoRA biases are not supported"),
    "modules_to_save": (
        lambda p: _edit_config(p, modules_to_save=["lm_head"]),
        r"modules_to_save .* is not supported",
    ),
    "rank_pattern": (
        lambda p: _edit_config(p, rank_pattern={"q_proj": 2}),
        r"rank_pattern \(per-module ranks\) is not supported",
    ),
    "embedding target": (
        lambda p: _edit_config(p, target_modules=["q_proj", "embed_tokens"]),
        r"'embed_tokens' \(embedding / output layer\) are not supported",
    ),
    "unknown target": (
        lambda p: _edit_config(p, target_modules=["q_proj", "c_attn"]),
        r"target module 'c_attn' is not supported",
    ),
    "rank above the max": (
        lambda p: _edit_config(p, r=64),
        r"rank r=64 is above max_lora_rank=8",
    ),
    "not lora": (lambda p: _edit_config(p, peft_type="IA3"), r"peft_type 'IA3' is not a LoRA"),
    "bad shape": (
        lambda p: _edit_tensors(
            p,
            lambda t: {
                k: (v[:, :-1] if k.endswith("layers.0.self_attn.q_proj.lora_A.weight") else v)
                for k, v in t.items()
            },
        ),
        r"layers\.0\.self_attn\.q_proj\.lora_A\.weight has shape \[4, 63\], expected \[4, 64\]",
    ),
    "layer past the model": (
        lambda p: _edit_tensors(
            p, lambda t: {k.replace("layers.1.", "layers.7."): v for k, v in t.items()}
        ),
        r"layer 7 is past the model's 2 layers",
    ),
    "lm_head tensor": (
        lambda p: _edit_tensors(
            p, lambda t: {**t, "base_model.model.lm_head.lora_A.weight": np.zeros((4, 64))}
        ),
        r"lm_head.lora_A.weight: adapters on the embedding or lm_head are not supported",
    ),
    "missing B": (
        lambda p: _edit_tensors(
            p, lambda t: {k: v for k, v in t.items() if "layers.1.mlp.up_proj.lora_B" not in k}
        ),
        r"layer 1 up_proj has lora_A but no lora_B",
    ),
    "nan": (
        lambda p: _edit_tensors(
            p,
            lambda t: {
                k: (v * np.nan if "layers.0.mlp.down_proj.lora_B" in k else v) for k, v in t.items()
            },
        ),
        r"down_proj.lora_B.weight holds a NaN",
    ),
    "pickled": (
        lambda p: (p / "adapter_model.safetensors").rename(p / "adapter_model.bin"),
        r"adapter_model.bin is a pickle",
    ),
    "truncated": (
        lambda p: (p / "adapter_model.safetensors").write_bytes(b"\x10\x00"),
        r"not a readable safetensors file",
    ),
    "config not json": (
        lambda p: (p / "adapter_config.json").write_text("{"),
        r"adapter_config.json is not valid JSON",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_adapters_are_named(tmp_path, config, case):
    path = write_adapter(tmp_path / "bad", BASE)
    edit, match = BAD[case]
    edit(path)
    with pytest.raises(ValueError, match=r"LoRA adapter 'bad' \(.*bad\): " + ".*" + match):
        read_adapter(request(path, "bad"), config, max_lora_rank=8)


def test_not_a_folder(tmp_path, config):
    with pytest.raises(ValueError, match=r"LoRA adapter 'a' .*: not a directory"):
        read_adapter(request(tmp_path / "nope"), config, max_lora_rank=8)


def test_moe_models_take_attention_adapters_only(tmp_path):
    base = GOLDEN_DIR / "qwen3_moe"
    cfg = load_hf_config(base)
    assert set(target_dims(cfg)) == {"wq", "wk", "wv", "wo"}
    ok = write_adapter(tmp_path / "attn", base, modules=("q_proj", "v_proj"))
    assert set(read_adapter(request(ok), cfg, 8).weights) == {"wq", "wv"}
    mlp = write_adapter(tmp_path / "mlp", base, modules=("q_proj", "gate_proj"))
    with pytest.raises(ValueError, match=r"'gate_proj': adapters on the MLP of a mixture-of"):
        read_adapter(request(mlp), cfg, 8)


@pytest.mark.parametrize(
    "args, match",
    [
        (("", 1, "/x"), r"lora_name must be a non-empty str"),
        (("a", 0, "/x"), r"lora_int_id must be an int >= 1"),
        (("a", True, "/x"), r"lora_int_id must be an int >= 1"),
        (("a", 1, ""), r"lora_path must name a PEFT adapter folder"),
    ],
)
def test_bad_requests(args, match):
    with pytest.raises(ValueError, match=match):
        LoRARequest(*args)
