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

Mixture-of-experts (`MOE_LAYER_NAMES`): the sparse layers l = config.moe_layers (the k-th of them
is row k of the stacks; the dense MLP names above then cover only config.dense_layers), experts
e = 0..E-1 stacked at load into [Ls, E, ...]:

    Mixtral    model.layers.{l}.block_sparse_moe.gate.weight        [E, D]  -> layers/router[k] (.T)
               model.layers.{l}.block_sparse_moe.experts.{e}.w1.weight [Im, D] -> we_gate[k, e] (.T)
               ...experts.{e}.w3.weight [Im, D] -> we_up[k, e] (.T); ...w2.weight [D, Im] -> we_down
    Qwen3-MoE  model.layers.{l}.mlp.gate.weight -> router; mlp.experts.{e}.gate_proj / up_proj /
               down_proj.weight -> we_gate / we_up / we_down (same shapes and transposes)

Dense families (`FAMILY_LAYER_NAMES`, `fused_rows`):

    Qwen3, Gemma 3  self_attn.q_norm.weight / k_norm.weight [Dh]   -> layers/q_norm, k_norm
    Gemma 2 / 3     post_attention_layernorm.weight [D] -> layers/post_attn_norm (attention output)
                    pre_feedforward_layernorm.weight    -> layers/mlp_norm
                    post_feedforward_layernorm.weight   -> layers/post_mlp_norm
                    (the stored weights w of Gemma's (1 + w) norms, as they are)
    Phi-3           self_attn.qkv_proj.weight [(H + 2 KVH) * Dh, D] rows [q | k | v] -> wq, wk, wv
                    mlp.gate_up_proj.weight   [2 I, D]              rows [gate | up] -> w_gate, w_up
                    (split at load: each param reads only its rows of the fused tensor)

A missing tensor, an unexpected tensor, or a shape mismatch raises ValueError naming the tensor.
The only names ignored are `*.rotary_emb.inv_freq` buffers (recomputed from the config), and
`lm_head.weight` of a tied model when it equals the embedding.

Untrusted directories: a malformed config.json, shard index or safetensors header raises
ModelLoadError naming the file. Every config size is checked against the safetensors headers
(layer count, then every tensor's name and shape) before any tensor is read or allocated. Only
files inside the model directory are opened (`inside`: resolved, so symlinks too); a Hugging
Face cache snapshot (`models--*/snapshots/<rev>/`, whose files link to `../../blobs/`) may also
read its own repository's blobs.
"""

from __future__ import annotations

import contextlib
import logging
import re
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open

from jaxserve.config import ModelConfig
from jaxserve.loading.loaded import ModelLoadError, read_json
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
# --- mixture-of-experts: our layer param -> HF name inside model.layers.{l} ({e}: the expert) ---
MOE_LAYER_NAMES = {
    "mixtral": {
        "router": "block_sparse_moe.gate.weight",
        "we_gate": "block_sparse_moe.experts.{e}.w1.weight",
        "we_up": "block_sparse_moe.experts.{e}.w3.weight",
        "we_down": "block_sparse_moe.experts.{e}.w2.weight",
    },
    "qwen3_moe": {
        "router": "mlp.gate.weight",
        "we_gate": "mlp.experts.{e}.gate_proj.weight",
        "we_up": "mlp.experts.{e}.up_proj.weight",
        "we_down": "mlp.experts.{e}.down_proj.weight",
    },
}
EXPERT_STACKS = ("we_gate", "we_up", "we_down")  # two stacked axes: [Ls, E, ...]


def _stacked_axes(path: str) -> int:
    """How many leading axes of a param were stacked from per-tensor HF names."""
    if not path.startswith("layers/"):
        return 0
    return 2 if path.removeprefix("layers/") in EXPERT_STACKS else 1


def _layer_names(config: ModelConfig, param: str) -> tuple[list[str], bool]:
    """The HF names of one stacked layer param (row-major over its stacked axes), transposed?"""
    moe = MOE_LAYER_NAMES.get(config.architecture, {})
    if param in moe:
        suffix = moe[param]
        names = [
            f"model.layers.{i}.{suffix}".format(e=e)
            for i in config.moe_layers
            for e in (range(config.num_experts) if param in EXPERT_STACKS else [0])
        ]
        return names, True
    family = FAMILY_LAYER_NAMES.get(config.architecture, {})
    suffix, transposed = family[param] if param in family else LAYER_NAMES[param]
    held = (
        config.dense_layers if param in ("w_gate", "w_up", "w_down") else range(config.num_layers)
    )
    return [f"model.layers.{i}.{suffix}" for i in held], transposed


# --- end mixture-of-experts ---
# --- dense families: per-architecture overrides of LAYER_NAMES, and fused tensors ---
_QK_NORMS = {
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
}
_GEMMA_NORMS = {
    "post_attn_norm": ("post_attention_layernorm.weight", False),
    "mlp_norm": ("pre_feedforward_layernorm.weight", False),
    "post_mlp_norm": ("post_feedforward_layernorm.weight", False),
}
FAMILY_LAYER_NAMES = {
    "qwen3": _QK_NORMS,
    "gemma2": _GEMMA_NORMS,
    "gemma3": _GEMMA_NORMS | _QK_NORMS,
    "phi3": {
        "wq": ("self_attn.qkv_proj.weight", True),
        "wk": ("self_attn.qkv_proj.weight", True),
        "wv": ("self_attn.qkv_proj.weight", True),
        "w_gate": ("mlp.gate_up_proj.weight", True),
        "w_up": ("mlp.gate_up_proj.weight", True),
    },
}
FAMILY_LAYER_NAMES["qwen3_moe"] = _QK_NORMS  # mixture-of-experts: Qwen3-MoE has Qwen3's attention


def fused_rows(config: ModelConfig, path: str) -> tuple[slice, int] | None:
    """(rows of the fused HF tensor holding param `path`, the fused tensor's row count), or None
    when the param has a tensor of its own."""
    if config.architecture != "phi3":
        return None
    qd, kd = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    i = config.intermediate_size
    parts = {
        "layers/wq": (0, qd, qd + 2 * kd),
        "layers/wk": (qd, qd + kd, qd + 2 * kd),
        "layers/wv": (qd + kd, qd + 2 * kd, qd + 2 * kd),
        "layers/w_gate": (0, i, 2 * i),
        "layers/w_up": (i, 2 * i, 2 * i),
    }
    if path not in parts:
        return None
    start, stop, total = parts[path]
    return slice(start, stop), total


# --- end dense families ---
GLOBAL_NAMES = {
    "embed": ("model.embed_tokens.weight", False),
    "final_norm": ("model.norm.weight", False),
    "lm_head": ("lm_head.weight", True),
}


def is_hf_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def allowed_root(model_dir: Path) -> Path:
    """The directory a model's files must resolve into: the model directory itself, or for a
    Hugging Face cache snapshot (models--org--name/snapshots/<rev>) the cached repository."""
    d = Path(model_dir).resolve()
    if d.parent.name == "snapshots" and d.parent.parent.name.startswith("models--"):
        return d.parent.parent
    return d


def model_name(model_dir: Path) -> str:
    """The model's name: its directory's, or for a Hugging Face cache snapshot the repository id
    (models--org--name -> org/name)."""
    root = allowed_root(model_dir)
    if root != Path(model_dir).resolve():
        return root.name.removeprefix("models--").replace("--", "/")
    return Path(model_dir).name


def inside(model_dir: Path, path: Path) -> Path:
    """`path` resolved (symlinks followed); ModelLoadError if that leaves the model directory."""
    resolved = Path(path).resolve()
    if not resolved.is_relative_to(allowed_root(model_dir)):
        raise ModelLoadError(
            path, f"resolves to {resolved}, outside the model directory {Path(model_dir)}"
        )
    return resolved


def open_safetensors(path: Path):
    """safe_open(path) with a malformed file (truncated, oversized header) as ModelLoadError."""
    try:
        return safe_open(path, framework="numpy")
    except (SafetensorError, OSError, ValueError) as e:
        raise ModelLoadError(path, f"not a readable safetensors file: {e}") from e


def hf_tensor_map(config: ModelConfig) -> dict[str, tuple[list[str], bool]]:
    """{param path: ([HF tensor name per layer, or one name], transposed?)} for this config."""
    out = {}
    for path in flat_shapes(config):
        if path.startswith("layers/"):
            names, transposed = _layer_names(config, path.removeprefix("layers/"))
        else:
            name, transposed = GLOBAL_NAMES[path]
            names = [name]
        out[path] = (names, transposed)
    return out


def tensor_files(model_dir: Path) -> dict[str, Path]:
    """{tensor name: safetensors file holding it}, from the shard index or the single file.

    Every file is checked to lie inside the model directory (`inside`) and to exist.
    """
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return _index_files(model_dir, index)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir}")
    out = {}
    for f in files:
        inside(model_dir, f)
        with open_safetensors(f) as st:
            out.update({name: f for name in st.keys()})
    return out


def _index_files(model_dir: Path, index: Path) -> dict[str, Path]:
    meta = read_json(inside(model_dir, index), "the shard index")
    weight_map = meta.get("weight_map") if isinstance(meta, dict) else None
    if weight_map is None:
        raise ModelLoadError(index, "the shard index's 'weight_map' is missing")
    if not isinstance(weight_map, dict):
        raise ModelLoadError(
            index, f"'weight_map' must be an object, got {type(weight_map).__name__}"
        )
    out, checked = {}, set()
    for name, fname in weight_map.items():
        if not isinstance(fname, str) or not fname:
            raise ModelLoadError(index, f"tensor {name!r} maps to {fname!r}, not a file name")
        f = model_dir / fname
        if fname not in checked:
            if Path(fname).is_absolute() or ".." in Path(fname).parts:
                raise ModelLoadError(
                    index, f"tensor {name!r} maps to {fname!r}, outside the model directory"
                )
            inside(model_dir, f)
            if not f.is_file():
                raise ModelLoadError(index, f"tensor {name!r} maps to {fname!r}, not a file")
            checked.add(fname)
        out[name] = f
    return out


def load_hf_config(model_dir: Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    hf = read_json(inside(model_dir, path), "config.json")
    try:
        return ModelConfig.from_hf(hf, name=model_name(model_dir))
    except ValueError as e:
        raise ModelLoadError(path, str(e)) from e


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _check_layer_count(model_dir: Path, config: ModelConfig, names) -> None:
    """The config's layer count against the layers the files hold, before any name list is built."""
    held = {int(m.group(1)) for n in names if (m := _LAYER.match(n))}
    if len(held) != config.num_layers:
        raise ModelLoadError(
            model_dir / "config.json",
            f"num_hidden_layers={config.num_layers} but the safetensors files hold "
            f"{len(held)} layers",
        )


def load_hf_dir(
    model_dir: str | Path, dtype: str = "float32", mesh=None
) -> tuple[ModelConfig, dict]:
    """Reads a HF directory into (config, params) with params in `dtype` on the default device."""
    model_dir = Path(model_dir)
    config = load_hf_config(model_dir)
    np_dtype(dtype)  # validate before reading
    files = tensor_files(model_dir)
    present = {n for n in files if not n.endswith("rotary_emb.inv_freq")}
    _check_layer_count(model_dir, config, present)
    name_map = hf_tensor_map(config)
    wanted = {n for names, _ in name_map.values() for n in names}
    missing = sorted(wanted - present)
    if missing:
        raise ModelLoadError(model_dir, f"missing tensor(s) {missing[:8]} (of {len(missing)})")
    extra = sorted(present - wanted)
    tied_head = config.tie_word_embeddings and extra == ["lm_head.weight"]
    if extra and not tied_head:
        raise ModelLoadError(model_dir, f"unexpected tensor(s) {extra[:8]} (of {len(extra)})")
    shapes = flat_shapes(config)
    flat: dict[str, np.ndarray] = {}
    with contextlib.ExitStack() as stack:
        handles = {f: stack.enter_context(open_safetensors(f)) for f in set(files.values())}

        def file_shape(name: str) -> tuple[int, ...]:
            try:
                return tuple(handles[files[name]].get_slice(name).get_shape())
            except SafetensorError as e:
                raise ModelLoadError(files[name], f"cannot read tensor {name}: {e}") from e

        def check(name: str, want: tuple[int, ...], fused=None) -> None:
            got = file_shape(name)
            if fused is not None:  # the fused tensor holds this param's rows and others'
                want = (fused[1], *want[1:])
            if got != want:
                raise ModelLoadError(
                    files[name],
                    f"tensor {name} has shape {got}, expected {want} (from config.json)",
                )

        def read(name: str, fused=None) -> np.ndarray:
            try:
                if fused is not None:  # only this param's rows of the fused tensor
                    return handles[files[name]].get_slice(name)[fused[0]]
                return handles[files[name]].get_tensor(name)
            except SafetensorError as e:
                raise ModelLoadError(files[name], f"cannot read tensor {name}: {e}") from e

        # Every header shape against the config before anything is read or allocated, so the
        # arrays below are exactly as large as the files' own tensors.
        for path, (names, transposed) in name_map.items():
            one = shapes[path][_stacked_axes(path) :]
            for name in names:
                check(name, one[::-1] if transposed else one, fused_rows(config, path))
        if tied_head:
            check("lm_head.weight", shapes["embed"])
        for path, (names, transposed) in name_map.items():
            shape = shapes[path]
            if path.startswith("layers/"):
                arr = None
                for i, name in enumerate(names):
                    x = read(name, fused_rows(config, path))
                    if arr is None:  # keep the file's dtype on the host (bf16 stays 2 bytes)
                        arr = np.empty(shape, x.dtype)
                    # row i of the stacked axes ([L] or, for expert stacks, [Ls, E] row-major)
                    arr.reshape(-1, *shape[_stacked_axes(path) :])[i] = x.T if transposed else x
            else:
                x = read(names[0])
                arr = np.ascontiguousarray(x.T if transposed else x)
            flat[path] = arr
        if tied_head:
            head = read("lm_head.weight")
            if not np.array_equal(head, flat["embed"].astype(head.dtype)):
                raise ModelLoadError(
                    files["lm_head.weight"],
                    "unexpected tensor lm_head.weight: config.json ties word embeddings but "
                    "lm_head.weight differs from model.embed_tokens.weight",
                )
    log.info("loaded %d tensors from %s (%s)", len(wanted), model_dir, dtype)
    return config, to_device(flat, config, dtype, mesh)  # mesh: each tensor onto its shards
