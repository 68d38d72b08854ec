"""PEFT LoRA adapter folders for tests, written as PEFT's save_pretrained writes them, and the
same model with an adapter merged into its weights (W + scale * B @ A, done here in float64, not
by the engine), which a request with the adapter must equal."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

PROJ = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
ALL = tuple(PROJ)


def module_dims(hf: dict, module: str) -> tuple[int, int]:
    """(in, out) of an HF projection of the config `hf`."""
    d = hf["hidden_size"]
    dh = hf.get("head_dim") or d // hf["num_attention_heads"]
    qd, kd = hf["num_attention_heads"] * dh, hf["num_key_value_heads"] * dh
    i = hf["intermediate_size"]
    return {
        "q_proj": (d, qd),
        "k_proj": (d, kd),
        "v_proj": (d, kd),
        "o_proj": (qd, d),
        "gate_proj": (d, i),
        "up_proj": (d, i),
        "down_proj": (i, d),
    }[module]


def write_adapter(
    out: Path,
    base: Path,
    *,
    rank: int = 4,
    alpha: float = 8.0,
    modules=ALL,
    seed: int = 0,
    layers=None,
    rslora: bool = False,
    size: float = 1.0,
    **config,
) -> Path:
    """A random LoRA adapter for the HF model folder `base` (B nonzero, unlike PEFT's init, so it
    changes the outputs); `config` adds or overrides adapter_config.json fields."""
    hf = json.loads((Path(base) / "config.json").read_text())
    rng = np.random.default_rng(seed)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for layer in range(hf["num_hidden_layers"]) if layers is None else layers:
        for m in modules:
            d_in, d_out = module_dims(hf, m)
            key = f"base_model.model.model.layers.{layer}.{PROJ[m]}.{m}"
            a = rng.normal(0, 1 / math.sqrt(d_in), (rank, d_in))
            b = rng.normal(0, size / math.sqrt(rank), (d_out, rank))
            tensors[f"{key}.lora_A.weight"] = a.astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = b.astype(np.float32)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    cfg = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": list(modules),
        "bias": "none",
        "use_rslora": rslora,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    cfg.update(config)
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return out


def merged_model(out: Path, base: Path, adapter: Path) -> Path:
    """A copy of the HF folder `base` with `adapter` merged into its weights."""
    out = Path(out)
    shutil.copytree(base, out)
    cfg = json.loads((Path(adapter) / "adapter_config.json").read_text())
    r, alpha = cfg["r"], cfg["lora_alpha"]
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    lora = load_file(str(Path(adapter) / "adapter_model.safetensors"))
    weights = load_file(str(out / "model.safetensors"))
    for key, a in lora.items():
        if ".lora_A." not in key:
            continue
        b = lora[key.replace(".lora_A.", ".lora_B.")]
        name = key.removeprefix("base_model.model.").split(".lora_A.")[0] + ".weight"
        w = weights[name].astype(np.float64) + scale * (b.astype(np.float64) @ a.astype(np.float64))
        weights[name] = w.astype(weights[name].dtype)
    save_file(weights, str(out / "model.safetensors"))
    return out
