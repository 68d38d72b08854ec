"""A PEFT LoRA adapter folder -> `LoRAAdapter`, checked against the model before any use. Host only.

A folder as PEFT's `save_pretrained` writes it:

    adapter_config.json         peft_type "LORA", r, lora_alpha, use_rslora, target_modules, ...
    adapter_model.safetensors   base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight [r, in]
                                base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight [out, r]

What a module's output becomes: y = x W + scale * (x A^T) B^T, scale = lora_alpha / r (rsLoRA:
lora_alpha / sqrt(r)). The adapter is kept in the engine's layout, per weight of `layers/`
(`models/llama.py`):

    weights[name] = (a f32[L, in, r], b f32[L, r, out])     b holds the scale; a layer the
                                                            adapter leaves alone is zeros

HF module -> engine weight: q_proj/k_proj/v_proj/o_proj -> wq/wk/wv/wo, gate_proj/up_proj/down_proj
-> w_gate/w_up/w_down; Phi-3's fused qkv_proj and gate_up_proj split their B rows over the weights
they feed (A is shared). Refused with a ValueError naming the option, at load: DoRA, LoRA biases,
modules_to_save, embedding or lm_head adapters, per-module ranks or alphas (rank_pattern /
alpha_pattern), fan_in_fan_out, MLP adapters on a mixture-of-experts model, a rank above
max_lora_rank, a pickled adapter_model.bin, any tensor whose shape is not the model's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open

from jaxserve.config import ModelConfig
from jaxserve.lora.request import LoRARequest

ATTENTION = ("wq", "wk", "wv", "wo")
MLP = ("w_gate", "w_up", "w_down")
# HF module name -> the engine weights its output feeds (a fused module splits its B rows)
MODULES = {
    "q_proj": ("wq",),
    "k_proj": ("wk",),
    "v_proj": ("wv",),
    "o_proj": ("wo",),
    "gate_proj": ("w_gate",),
    "up_proj": ("w_up",),
    "down_proj": ("w_down",),
    "qkv_proj": ("wq", "wk", "wv"),
    "gate_up_proj": ("w_gate", "w_up"),
}
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(\w+)\.lora_([AB])(?:\.[A-Za-z_]\w*)?\.weight$"
)


@dataclasses.dataclass
class LoRAAdapter:
    """A checked adapter in the engine's layout (see the module docstring)."""

    request: LoRARequest
    rank: int
    scale: float
    weights: dict[str, tuple[np.ndarray, np.ndarray]]  # name -> (a [L, in, r], b [L, r, out])

    @property
    def lora_int_id(self) -> int:
        return self.request.lora_int_id


def lora_targets(config: ModelConfig) -> tuple[str, ...]:
    """The weights that take adapters: the attention projections, and the MLP's unless the model
    has mixture-of-experts layers (their experts take none, and its dense MLP stacks hold only
    some layers)."""
    return ATTENTION if config.moe_layers else ATTENTION + MLP


def target_dims(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """{weight: (in, out)} of each weight that takes adapters."""
    c = config
    qd, kd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    d, i = c.hidden_size, c.intermediate_size
    dims = {
        "wq": (d, qd),
        "wk": (d, kd),
        "wv": (d, kd),
        "wo": (qd, d),
        "w_gate": (d, i),
        "w_up": (d, i),
        "w_down": (i, d),
    }
    return {name: dims[name] for name in lora_targets(config)}


def read_adapter(request: LoRARequest, config: ModelConfig, max_lora_rank: int) -> LoRAAdapter:
    """The adapter `request` names, read and checked against `config`; ValueError naming the
    adapter, the file and the problem."""
    root = Path(request.lora_path)

    def fail(problem: str) -> ValueError:
        return ValueError(f"LoRA adapter {request.lora_name!r} ({root}): {problem}")

    if not root.is_dir():
        raise fail("not a directory")
    try:
        cfg = json.loads((root / "adapter_config.json").read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise fail(f"adapter_config.json is not valid JSON: {e}") from e
    except OSError as e:
        raise fail(f"cannot read adapter_config.json: {e}") from e
    if not isinstance(cfg, dict):
        raise fail("adapter_config.json must hold an object")
    rank, scale = _check_config(cfg, config, max_lora_rank, fail)
    path = root / "adapter_model.safetensors"
    if not path.is_file():
        bin_ = (root / "adapter_model.bin").is_file()
        raise fail(
            "adapter_model.bin is a pickle, which jaxserve does not load: save the adapter with "
            "safe_serialization=True (adapter_model.safetensors)"
            if bin_
            else "adapter_model.safetensors is missing"
        )
    if not path.resolve().is_relative_to(root.resolve()):
        raise fail(f"{path.name} resolves outside the adapter folder")
    dims = target_dims(config)
    L = config.num_layers
    weights = {
        n: (np.zeros((L, i, rank), np.float32), np.zeros((L, rank, o), np.float32))
        for n, (i, o) in dims.items()
    }
    seen: set[tuple[int, str, str]] = set()
    try:
        with safe_open(path, framework="numpy") as st:
            keys = list(st.keys())
            for key in keys:
                layer, module, which = _parse_key(key, config, fail)
                names = MODULES[module]
                if any(n not in dims for n in names):
                    raise fail(
                        f"{key}: adapters on the MLP of a mixture-of-experts model are not supported"
                    )
                d_in = dims[names[0]][0]
                outs = [dims[n][1] for n in names]
                want = (rank, d_in) if which == "A" else (sum(outs), rank)
                shape = tuple(st.get_slice(key).get_shape())  # checked before reading
                if shape != want:
                    raise fail(
                        f"{key} has shape {list(shape)}, expected {list(want)} for this model"
                    )
                t = np.asarray(st.get_tensor(key), np.float32)
                if not np.isfinite(t).all():
                    raise fail(f"{key} holds a NaN or an infinity")
                if which == "A":
                    for n in names:
                        weights[n][0][layer] = t.T  # [in, r]
                else:
                    for n, lo, hi in zip(names, np.cumsum([0, *outs[:-1]]), np.cumsum(outs)):
                        weights[n][1][layer] = scale * t[lo:hi].T  # [r, out]
                seen.add((layer, module, which))
    except SafetensorError as e:
        raise fail(f"{path.name} is not a readable safetensors file: {e}") from e
    for layer, module, which in seen:
        other = "B" if which == "A" else "A"
        if (layer, module, other) not in seen:
            raise fail(f"layer {layer} {module} has lora_{which} but no lora_{other}")
    if not seen:
        raise fail(f"{path.name} holds no LoRA weights of a supported module ({sorted(MODULES)})")
    used = {n for _, m, _ in seen for n in MODULES[m]}
    return LoRAAdapter(request, rank, scale, {n: w for n, w in weights.items() if n in used})


def _check_config(cfg: dict, config: ModelConfig, max_lora_rank: int, fail) -> tuple[int, float]:
    """(r, scale) of a PEFT adapter_config.json, or `fail` naming the unsupported option."""
    peft_type = cfg.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise fail(f"peft_type {peft_type!r} is not a LoRA adapter")
    refused = {
        "use_dora": "DoRA",
        "fan_in_fan_out": "fan_in_fan_out (weights stored transposed, as GPT-2's Conv1D)",
        "modules_to_save": "modules_to_save (fully trained modules beside the adapter)",
        "rank_pattern": "rank_pattern (per-module ranks)",
        "alpha_pattern": "alpha_pattern (per-module alphas)",
        "lora_bias": "lora_bias",
        "target_parameters": "target_parameters",
        # PEFT options that change what the adapter computes beyond W + scale * B @ A
        "layer_replication": "layer_replication",
        "trainable_token_indices": "trainable_token_indices (trained embedding rows)",
        "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
        "use_qalora": "QA-LoRA (use_qalora)",
        "use_bdlora": "use_bdlora",
        "arrow_config": "Arrow routing (arrow_config)",
        "monteclora_config": "monteclora_config",
        "kasa_config": "kasa_config",
    }
    for key, what in refused.items():
        if cfg.get(key):
            raise fail(f"{what} is not supported (adapter_config.json {key}={cfg[key]!r})")
    if cfg.get("bias", "none") != "none":
        raise fail(f"LoRA biases are not supported (adapter_config.json bias={cfg['bias']!r})")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise fail(f"adapter_config.json r must be an int >= 1, got {r!r}")
    if r > max_lora_rank:
        raise fail(f"rank r={r} is above max_lora_rank={max_lora_rank}: raise max_lora_rank")
    if alpha is None:
        alpha = 8  # PEFT's default
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise fail(f"adapter_config.json lora_alpha must be a number, got {alpha!r}")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        for t in targets:
            if t in ("embed_tokens", "lm_head", "wte", "word_embeddings"):
                raise fail(f"adapters on {t!r} (embedding / output layer) are not supported")
            if t not in MODULES and t != "all-linear":
                raise fail(f"target module {t!r} is not supported (supported: {sorted(MODULES)})")
            if t in ("gate_proj", "up_proj", "down_proj", "gate_up_proj") and config.moe_layers:
                raise fail(
                    f"target module {t!r}: adapters on the MLP of a mixture-of-experts model are "
                    "not supported"
                )
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return r, float(scale)


def _parse_key(key: str, config: ModelConfig, fail) -> tuple[int, str, str]:
    """(layer, HF module, 'A' | 'B') of an adapter tensor name, or `fail` naming it."""
    if "lora_embedding" in key or "embed_tokens" in key or "lm_head" in key:
        raise fail(f"{key}: adapters on the embedding or lm_head are not supported")
    if "lora_magnitude_vector" in key:
        raise fail(f"{key}: DoRA is not supported")
    m = _KEY.match(key)
    if m is None:
        raise fail(f"tensor {key!r} is not a LoRA weight of a decoder layer's projection")
    layer, module, which = int(m.group(1)), m.group(2), m.group(3)
    if module not in MODULES:
        raise fail(f"{key}: module {module!r} is not supported (supported: {sorted(MODULES)})")
    if layer >= config.num_layers:
        raise fail(f"{key}: layer {layer} is past the model's {config.num_layers} layers")
    return layer, module, which
