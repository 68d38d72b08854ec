"""GGUF file -> (ModelConfig, params), with `gguf.GGUFReader` and numpy dequantization (no torch).

    open_gguf(path)                      -> GGUFReader (memory-mapped; ~4 s to parse SmolLM2's vocab)
    config_from_gguf(reader)             -> ModelConfig from the `{arch}.*` metadata keys
    gguf_tensor_map(reader, config)      -> {param path: [ReaderTensor per layer] or [one tensor]}
    load_gguf_params(reader, config, dtype) -> params pytree (dequantized, un-permuted, transposed)

Name map (GGUF shapes are listed innermost-first, so a linear weight's GGUF shape [in, out] is
already our `[in, out]`; the numpy view and the dequantized array are [out, in]):

    token_embd.weight          -> embed        (numpy [V, D])
    blk.{i}.attn_norm.weight   -> layers/attn_norm[i]
    blk.{i}.attn_q.weight      -> layers/wq[i]    rows un-permuted (llama), then .T
    blk.{i}.attn_k.weight      -> layers/wk[i]    rows un-permuted (llama), then .T
    blk.{i}.attn_v.weight      -> layers/wv[i]
    blk.{i}.attn_{q,k,v}.bias  -> layers/b{q,k,v}[i]  (qwen2)
    blk.{i}.attn_output.weight -> layers/wo[i]
    blk.{i}.ffn_norm.weight    -> layers/mlp_norm[i]
    blk.{i}.ffn_gate.weight    -> layers/w_gate[i]
    blk.{i}.ffn_up.weight      -> layers/w_up[i]
    blk.{i}.ffn_down.weight    -> layers/w_down[i]
    output_norm.weight         -> final_norm
    output.weight              -> lm_head      (absent: tied to token_embd)

llama.cpp's converter permutes the rows of llama's q/k projections so that each head's rotary
pairs are interleaved (GPT-J layout); our RoPE uses Hugging Face's rotate-half layout, so
`unpermute_rows` undoes it. The permutation only moves whole rows (output features), so it applies
equally to dequantized weights and to raw quantized block rows (the INT4 import path uses that).
"""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
from gguf.quants import dequantize

from jaxserve.config import ModelConfig
from jaxserve.loading.params import flat_shapes, np_dtype, to_device

log = logging.getLogger(__name__)

Q = gguf.GGMLQuantizationType
# Tensor types this loader dequantizes (all through gguf.quants, in numpy).
SUPPORTED_TYPES = frozenset(
    {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1}
    | {Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}
)
SUPPORTED_ARCHS = ("llama", "qwen2")

LAYER_NAMES = {
    "attn_norm": "attn_norm.weight",
    "wq": "attn_q.weight",
    "wk": "attn_k.weight",
    "wv": "attn_v.weight",
    "bq": "attn_q.bias",
    "bk": "attn_k.bias",
    "bv": "attn_v.bias",
    "wo": "attn_output.weight",
    "mlp_norm": "ffn_norm.weight",
    "w_gate": "ffn_gate.weight",
    "w_up": "ffn_up.weight",
    "w_down": "ffn_down.weight",
}
# Stored [out, in] like torch's nn.Linear: transposed to our [in, out].
LINEAR_PATHS = frozenset(
    {f"layers/{k}" for k in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")} | {"lm_head"}
)
GLOBAL_NAMES = {
    "embed": "token_embd.weight",
    "final_norm": "output_norm.weight",
    "lm_head": "output.weight",
}


def open_gguf(path: str | Path) -> gguf.GGUFReader:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"GGUF file {path} does not exist")
    try:
        return gguf.GGUFReader(path)
    except ValueError as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e


def field(reader: gguf.GGUFReader, key: str, default=None):
    """The value of a metadata key (str, number, bool or list), or `default` when absent."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def config_from_gguf(reader: gguf.GGUFReader, name: str = "") -> ModelConfig:
    """Builds the ModelConfig from `general.architecture` and its `{arch}.*` keys."""
    arch = field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(
            f"unknown architecture: GGUF general.architecture {arch!r}; supported: {SUPPORTED_ARCHS}"
        )
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names or field(reader, f"{arch}.rope.scaling.type", "none") != "none":
        raise ValueError(
            f"GGUF rope scaling (rope_freqs.weight / {arch}.rope.scaling.type) is not supported"
        )

    def req(key):
        v = field(reader, f"{arch}.{key}")
        if v is None:
            raise ValueError(f"GGUF metadata key {arch}.{key} is missing")
        return v

    heads = int(req("attention.head_count"))
    hidden = int(req("embedding_length"))
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    vocab = field(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = (
            int(embd.shape[1]) if embd is not None else len(field(reader, "tokenizer.ggml.tokens"))
        )
    eos = field(reader, "tokenizer.ggml.eos_token_id")
    bos = field(reader, "tokenizer.ggml.bos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(req("feed_forward_length")),
        num_layers=int(req("block_count")),
        num_heads=heads,
        num_kv_heads=int(field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(field(reader, f"{arch}.attention.key_length", hidden // heads)),
        rope_theta=float(field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(req("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        max_position_embeddings=int(field(reader, f"{arch}.context_length", 4096)),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
        name=name or str(field(reader, "general.name", "")),
    )


def gguf_tensor_map(reader: gguf.GGUFReader, config: ModelConfig) -> dict[str, list]:
    """{param path: [ReaderTensor for layer 0..L-1]} for layer params, [one tensor] for the rest.

    Raises ValueError naming any missing or unexpected tensor, or one whose GGUF shape differs
    from what the config implies. Tensor types are not checked here (the INT4 importer reads
    Q4_0/Q4_1 blocks itself); `load_gguf_params` checks them.
    """
    by_name = {t.name: t for t in reader.tensors}
    out: dict[str, list] = {}
    wanted = set()
    for path, shape in flat_shapes(config).items():
        if path.startswith("layers/"):
            suffix = LAYER_NAMES[path.removeprefix("layers/")]
            names = [f"blk.{i}.{suffix}" for i in range(config.num_layers)]
            one = shape[1:]
        else:
            names, one = [GLOBAL_NAMES[path]], shape
        # GGUF lists dims innermost-first: our [in, out] linears match it as is; embed is [D, V].
        want = list(one[::-1]) if path == "embed" else list(one)
        tensors = []
        for n in names:
            wanted.add(n)
            t = by_name.get(n)
            if t is None:
                raise ValueError(f"GGUF is missing tensor {n} (for {path})")
            got = [int(d) for d in t.shape]
            if got != want:
                raise ValueError(f"GGUF tensor {n} has shape {got}, expected {want} (for {path})")
            tensors.append(t)
        out[path] = tensors
    extra = sorted(set(by_name) - wanted)
    if extra:
        raise ValueError(f"GGUF has unexpected tensor(s) {extra[:8]} (of {len(extra)})")
    return out


def unpermute_heads(path: str, config: ModelConfig) -> int | None:
    """Heads of llama.cpp's q/k row permutation on this param path, None when not permuted."""
    if config.architecture != "llama":  # llama.cpp permutes only its LlamaModel q/k
        return None
    return {"layers/wq": config.num_heads, "layers/wk": config.num_kv_heads}.get(path)


def permute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF rotate-half rows -> llama.cpp interleaved rows (what convert_hf_to_gguf does). Axis 0 = out."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of `permute_rows`: w[out, ...] (floats or raw quantized block rows) -> HF row order."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize_tensor(t) -> np.ndarray:
    """A ReaderTensor -> f32 numpy array in numpy order ([out, in] for a linear weight)."""
    if t.tensor_type not in SUPPORTED_TYPES:
        raise ValueError(
            f"GGUF tensor {t.name} has unsupported type {t.tensor_type.name}; "
            f"supported: {sorted(q.name for q in SUPPORTED_TYPES)}"
        )
    x = dequantize(t.data, t.tensor_type)
    return x.reshape([int(d) for d in reversed(t.shape)])


def load_gguf_params(reader: gguf.GGUFReader, config: ModelConfig, dtype: str = "float32") -> dict:
    """Dequantizes every mapped tensor, un-permutes llama q/k, transposes linears to [in, out]."""
    np_dtype(dtype)  # validate before the slow part
    shapes = flat_shapes(config)
    flat = {}
    for path, tensors in gguf_tensor_map(reader, config).items():
        heads = unpermute_heads(path, config)
        linear = path in LINEAR_PATHS
        arr = np.empty(shapes[path], np.float32) if path.startswith("layers/") else None
        for i, t in enumerate(tensors):
            x = dequantize_tensor(t)  # numpy order: [out, in] for linears
            if heads is not None:
                x = unpermute_rows(x, heads)
            if linear:
                x = x.T
            if arr is None:
                arr = np.ascontiguousarray(x)
            else:
                arr[i] = x
        flat[path] = arr
    return to_device(flat, config, dtype)


def load_gguf(path: str | Path, dtype: str = "float32", reader=None) -> tuple[ModelConfig, dict]:
    """Reads a GGUF file into (config, params). Pass an open `reader` to avoid parsing twice."""
    reader = reader if reader is not None else open_gguf(path)
    config = config_from_gguf(reader, name=Path(path).stem)
    params = load_gguf_params(reader, config, dtype)
    log.info("loaded %d GGUF tensors from %s (%s)", len(reader.tensors), path, dtype)
    return config, params
