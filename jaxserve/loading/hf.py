"""Hugging Face model directory -> (ModelConfig, params), through an explicit name map.

    config.json                      -> ModelConfig.from_hf
    model.safetensors                (one file) or
    model-0000k-of-0000n.safetensors + model.safetensors.index.json (sharded)
        read tensor by tensor with safetensors' numpy backend (no torch), shape-checked before reading

Name map (HF name -> our param path; HF linear weights are [out, in] and are transposed to [in, out];
per-layer tensors are stacked on a leading [L] axis):

    model.embed_tokens.weight                       [V, D]    -> embed
    model.layers.{i}.input_layernorm.weight         [D]       -> layers/attn_norm[i]
    model.layers.{i}.self_attn.q_proj.weight        [H*Dh, D] -> layers/wq[i]     (.T)
    model.layers.{i}.self_attn.k_proj.weight        [KVH*Dh, D] -> layers/wk[i]   (.T)
    model.layers.{i}.self_attn.v_proj.weight        [KVH*Dh, D] -> layers/wv[i]   (.T)
    model.layers.{i}.self_attn.{q,k,v}_proj.bias    (Qwen2)   -> layers/b{q,k,v}[i]
    model.layers.{i}.self_attn.o_proj.weight        [D, H*Dh] -> layers/wo[i]     (.T)
    model.layers.{i}.post_attention_layernorm.weight [D]      -> layers/mlp_norm[i]
    model.layers.{i}.mlp.gate_proj.weight           [I, D]    -> layers/w_gate[i] (.T)
    model.layers.{i}.mlp.up_proj.weight             [I, D]    -> layers/w_up[i]   (.T)
    model.layers.{i}.mlp.down_proj.weight           [D, I]    -> layers/w_down[i] (.T)
    model.norm.weight                               [D]       -> final_norm
    lm_head.weight                                  [V, D]    -> lm_head (.T)     (absent if tied)

A missing tensor, an unexpected tensor, or a shape mismatch raises ValueError naming the tensor.
The only names ignored are `*.rotary_emb.inv_freq` buffers (recomputed from the config), and
`lm_head.weight` of a tied model when it equals the embedding.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import numpy as np
from safetensors import safe_open

from jaxserve.config import ModelConfig
from jaxserve.loading.params import flat_shapes, np_dtype, to_device

log = logging.getLogger(__name__)

# our layer param -> (HF name inside model.layers.{i}, transposed?)
LAYER_NAMES = {
    "attn_norm": ("input_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "bq": ("self_attn.q_proj.bias", False),
    "bk": ("self_attn.k_proj.bias", False),
    "bv": ("self_attn.v_proj.bias", False),
    "wo": ("self_attn.o_proj.weight", True),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
}
GLOBAL_NAMES = {
    "embed": ("model.embed_tokens.weight", False),
    "final_norm": ("model.norm.weight", False),
    "lm_head": ("lm_head.weight", True),
}


def is_hf_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def hf_tensor_map(config: ModelConfig) -> dict[str, tuple[list[str], bool]]:
    """{param path: ([HF tensor name per layer, or one name], transposed?)} for this config."""
    out = {}
    for path in flat_shapes(config):
        if path.startswith("layers/"):
            suffix, transposed = LAYER_NAMES[path.removeprefix("layers/")]
            names = [f"model.layers.{i}.{suffix}" for i in range(config.num_layers)]
        else:
            name, transposed = GLOBAL_NAMES[path]
            names = [name]
        out[path] = (names, transposed)
    return out


def tensor_files(model_dir: Path) -> dict[str, Path]:
    """{tensor name: safetensors file holding it}, from the shard index or the single file."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / fname for name, fname in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir}")
    out = {}
    for f in files:
        with safe_open(f, framework="numpy") as st:
            out.update({name: f for name in st.keys()})
    return out


def load_hf_config(model_dir: Path) -> ModelConfig:
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    return ModelConfig.from_hf(hf, name=Path(model_dir).name)


def load_hf_dir(model_dir: str | Path, dtype: str = "float32") -> tuple[ModelConfig, dict]:
    """Reads a HF directory into (config, params) with params in `dtype` on the default device."""
    model_dir = Path(model_dir)
    config = load_hf_config(model_dir)
    np_dtype(dtype)  # validate before reading
    files = tensor_files(model_dir)
    present = {n for n in files if not n.endswith("rotary_emb.inv_freq")}
    name_map = hf_tensor_map(config)
    wanted = {n for names, _ in name_map.values() for n in names}
    missing = sorted(wanted - present)
    if missing:
        raise ValueError(f"{model_dir}: missing tensor(s) {missing[:8]} (of {len(missing)})")
    extra = sorted(present - wanted)
    tied_head = config.tie_word_embeddings and extra == ["lm_head.weight"]
    if extra and not tied_head:
        raise ValueError(f"{model_dir}: unexpected tensor(s) {extra[:8]} (of {len(extra)})")
    shapes = flat_shapes(config)
    flat: dict[str, np.ndarray] = {}
    with contextlib.ExitStack() as stack:
        handles = {
            f: stack.enter_context(safe_open(f, framework="numpy")) for f in set(files.values())
        }

        def read(name: str, want: tuple[int, ...]) -> np.ndarray:
            sl = handles[files[name]].get_slice(name)
            got = tuple(sl.get_shape())
            if got != want:
                raise ValueError(
                    f"{model_dir}: tensor {name} has shape {got}, expected {want} "
                    f"(from config.json)"
                )
            return handles[files[name]].get_tensor(name)

        for path, (names, transposed) in name_map.items():
            shape = shapes[path]
            one = shape[1:] if path.startswith("layers/") else shape
            hf_shape = one[::-1] if transposed else one
            if path.startswith("layers/"):
                arr = None
                for i, name in enumerate(names):
                    x = read(name, hf_shape)
                    if arr is None:  # keep the file's dtype on the host (bf16 stays 2 bytes)
                        arr = np.empty(shape, x.dtype)
                    arr[i] = x.T if transposed else x
            else:
                x = read(names[0], hf_shape)
                arr = np.ascontiguousarray(x.T if transposed else x)
            flat[path] = arr
        if tied_head:
            head = read("lm_head.weight", shapes["embed"])
            if not np.array_equal(head, flat["embed"].astype(head.dtype)):
                raise ValueError(
                    f"{model_dir}: unexpected tensor lm_head.weight: config.json ties word "
                    "embeddings but lm_head.weight differs from model.embed_tokens.weight"
                )
    log.info("loaded %d tensors from %s (%s)", len(wanted), model_dir, dtype)
    return config, to_device(flat, config, dtype)
