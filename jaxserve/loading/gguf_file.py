"""GGUF file -> (ModelConfig, params), with `gguf.GGUFReader` and numpy dequantization (no torch).

    open_gguf(path)                      -> GGUFReader (memory-mapped; ~4 s to parse SmolLM2's vocab)
    config_from_gguf(reader)             -> ModelConfig from the `{arch}.*` metadata keys
    read_config(path, reader)            -> the same, its errors as ModelLoadError naming the file
    gguf_sources(reader, config)         -> {param path: [(ReaderTensor, fused rows | None)]}
    gguf_tensor_map(reader, config)      -> {param path: [ReaderTensor per layer] or [one tensor]}
    tensor_param(path, tensor, rows, config) -> one layer's param array (numpy, f32)
    load_gguf_params(reader, config, dtype) -> params pytree (dequantized, un-permuted, transposed)

Architectures: llama, qwen2 here; qwen3, gemma2, gemma3, phi3, qwen3moe in `gguf_archs.py` (their
metadata keys, q/k norms, Gemma's sandwich and (1 + w) norms, phi3's fused tensors and LongRoPE
factors, qwen3moe's router and 3-D expert tensors).

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
    rope_freqs.weight          -> config.rope_scaling (rope_type 'freq_factors'): f32[Dh/2], the
                                  per-frequency divisors llama.cpp's converter writes for Llama 3.1
                                  (`rope_type: llama3`) scaling: inv_freq = base_inv / rope_freqs

`{arch}.rope.scaling.type` 'linear' (with `rope.scaling.factor`) is read too; YaRN is refused.
Stored [out, in] like torch's nn.Linear, linears are transposed to our [in, out]
(`gguf_archs.param_kind`).

llama.cpp's converter permutes the rows of llama's q/k projections so that each head's rotary
pairs are interleaved (GPT-J layout); our RoPE uses Hugging Face's rotate-half layout, so
`unpermute_rows` undoes it. The permutation only moves whole rows (output features), so it applies
equally to dequantized weights and to raw quantized block rows (the INT4 import path uses that).

Untrusted files: a header the reader cannot parse (absurd key lengths or counts, truncation) and
every metadata value that is missing, of the wrong type, non-positive or absurdly large raise
ModelLoadError naming the file; `block_count` is checked against the blocks the tensor infos
hold, and every tensor's name and shape against the config, before anything is dequantized.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import gguf
import numpy as np
from gguf.quants import dequantize

from jaxserve.config import ModelConfig, RopeScaling
from jaxserve.config.model import MAX_SIZES, check_positive_number, check_size
from jaxserve.loading import gguf_archs
from jaxserve.loading.loaded import ModelLoadError
from jaxserve.loading.params import flat_shapes, np_dtype, to_device

log = logging.getLogger(__name__)

Q = gguf.GGMLQuantizationType
# Tensor types this loader dequantizes (all through gguf.quants, in numpy).
SUPPORTED_TYPES = frozenset(
    {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1}
    | {Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}
)
SUPPORTED_ARCHS = ("llama", "qwen2", *gguf_archs.ARCHS)  # qwen3 gemma2 gemma3 phi3 qwen3moe

LAYER_NAMES = gguf_archs.LAYER_NAMES
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
    # gguf's parser indexes past the end of the file on absurd lengths and counts (IndexError).
    except (ValueError, IndexError, KeyError, TypeError, OverflowError) as e:
        raise ModelLoadError(path, f"not a readable GGUF file: {type(e).__name__}: {e}") from e


def read_config(path: str | Path, reader: gguf.GGUFReader) -> ModelConfig:
    """`config_from_gguf` with its errors as ModelLoadError naming the file."""
    try:
        return config_from_gguf(reader, name=Path(path).stem)
    except ValueError as e:
        raise ModelLoadError(path, str(e)) from e


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

    def req(key):
        v = field(reader, f"{arch}.{key}")
        if v is None:
            raise ValueError(f"GGUF metadata key {arch}.{key} is missing")
        return v

    def get(key, default=None):  # for gguf_archs: default None = required
        return req(key) if default is None else field(reader, f"{arch}.{key}", default)

    def size(key, field_name, default=None):
        v = req(key) if default is None else field(reader, f"{arch}.{key}", default)
        return check_size(f"GGUF metadata key {arch}.{key}", v, MAX_SIZES[field_name])

    def number(key, default=None):
        v = req(key) if default is None else field(reader, f"{arch}.{key}", default)
        return check_positive_number(f"GGUF metadata key {arch}.{key}", v)

    def token_id(key):
        v = field(reader, f"tokenizer.ggml.{key}")
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(
                f"GGUF metadata key tokenizer.ggml.{key} must be a token id, got {v!r}"
            )
        return int(v)

    num_layers = size("block_count", "num_layers")
    held = {int(m.group(1)) for n in names if (m := re.match(r"blk\.(\d+)\.", n))}
    if len(held) != num_layers:
        raise ValueError(
            f"GGUF metadata key {arch}.block_count={num_layers} but the file holds "
            f"{len(held)} blocks"
        )
    heads = size("attention.head_count", "num_heads")
    hidden = size("embedding_length", "hidden_size")
    head_dim = size("attention.key_length", "head_dim", max(hidden // heads, 1))
    rot = field(reader, f"{arch}.rope.dimension_count", head_dim)
    if rot != head_dim:
        raise ValueError(
            f"GGUF metadata key {arch}.rope.dimension_count={rot!r} != head_dim {head_dim}: "
            "partial rotary embeddings are not supported"
        )
    max_pos = size("context_length", "max_position_embeddings", 4096)
    rope_scaling = _rope_scaling(reader, arch, max_pos)
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    vocab = field(reader, f"{arch}.vocab_size")
    if vocab is None and embd is not None and len(embd.shape) == 2:
        vocab = int(embd.shape[1])
    elif vocab is None:
        tokens = field(reader, "tokenizer.ggml.tokens")
        if not isinstance(tokens, list):
            raise ValueError(
                f"GGUF has no {arch}.vocab_size, no 2-D token_embd.weight and no tokenizer.ggml.tokens"
            )
        vocab = len(tokens)
    vocab = check_size("GGUF vocab size", vocab, MAX_SIZES["vocab_size"])
    eos, bos = token_id("eos_token_id"), token_id("bos_token_id")
    return ModelConfig(
        architecture=gguf_archs.ARCHS.get(arch, arch),
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=size("feed_forward_length", "intermediate_size"),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=size("attention.head_count_kv", "num_kv_heads", heads),
        head_dim=head_dim,
        rope_theta=number("rope.freq_base", 10000.0),
        rope_scaling=rope_scaling,
        rms_norm_eps=number("attention.layer_norm_rms_epsilon"),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        max_position_embeddings=max_pos,
        bos_token_id=bos,
        eos_token_ids=() if eos is None else (eos,),
        name=name or str(field(reader, "general.name", "")),
        **gguf_archs.family_fields(get, arch, names, num_layers, hidden, heads, head_dim),
    )


ROPE_FREQS = "rope_freqs.weight"  # not a param: read into the config (`_rope_scaling`)
CONFIG_TENSORS = (ROPE_FREQS, *gguf_archs.ROPE_FACTORS)


def _rope_scaling(reader: gguf.GGUFReader, arch: str, max_pos: int) -> RopeScaling | None:
    """RoPE scaling from `rope_freqs.weight` (llama3 divisors), phi3's `rope_factors_*` (LongRoPE)
    or `{arch}.rope.scaling.*`."""
    by_name = {t.name: t for t in reader.tensors if t.name in CONFIG_TENSORS}
    if arch == "phi3":
        scaling = gguf_archs.longrope(
            lambda key, default=None: field(reader, f"{arch}.{key}", default),
            by_name,
            dequantize_tensor,
            max_pos,
        )
        if scaling is not None:
            return scaling
    kind = field(reader, f"{arch}.rope.scaling.type", "none")
    freqs = by_name.get(ROPE_FREQS)
    if freqs is not None:
        if kind not in ("none", "llama3") or len(freqs.shape) != 1:
            raise ValueError(
                f"GGUF {ROPE_FREQS} (shape {[int(d) for d in freqs.shape]}) with "
                f"{arch}.rope.scaling.type {kind!r} is not supported"
            )
        divisors = dequantize_tensor(freqs).astype(np.float64)
        return RopeScaling(rope_type="freq_factors", freq_factors=tuple(divisors.tolist()))
    if kind == "none":
        return None
    if kind == "linear":
        factor = field(reader, f"{arch}.rope.scaling.factor")
        return RopeScaling(
            factor=check_positive_number(f"GGUF metadata key {arch}.rope.scaling.factor", factor),
            rope_type="linear",
        )
    raise ValueError(f"GGUF {arch}.rope.scaling.type {kind!r} is not supported (none, linear)")


def gguf_sources(reader: gguf.GGUFReader, config: ModelConfig) -> dict[str, list]:
    """{param path: [(ReaderTensor, rows) per stacked layer]} ([one pair] for the rest); rows is
    the slice of a fused tensor's rows holding the param (phi3's attn_qkv / ffn_up), else None.

    Raises ValueError naming any missing or unexpected tensor, or one whose GGUF shape differs
    from what the config implies. Tensor types are not checked here (the INT4 importer reads
    Q4_0/Q4_1 blocks itself); `load_gguf_params` checks them.
    """
    by_name = {t.name: t for t in reader.tensors}
    out: dict[str, list] = {}
    wanted = set()
    for path, shape in flat_shapes(config).items():
        if path.startswith("layers/"):
            param = path.removeprefix("layers/")
            sources = [
                gguf_archs.layer_source(config, param, i, by_name)
                for i in gguf_archs.layer_indices(config, param)
            ]
            one = shape[1:]
        else:
            sources, one = [(GLOBAL_NAMES[path], None, 0)], shape
        # GGUF lists dims innermost-first (the numpy shape reversed): our [in, out] linears
        # match it as is; embed is [D, V]; a fused tensor holds `total` rows.
        np_shape = list(gguf_archs.numpy_shape(path, one))
        pairs = []
        for n, rows, total in sources:
            wanted.add(n)
            t = by_name.get(n)
            if t is None:
                raise ValueError(f"GGUF is missing tensor {n} (for {path})")
            got = [int(d) for d in t.shape]
            want = (np_shape if rows is None else [total, *np_shape[1:]])[::-1]
            if got != want:
                raise ValueError(f"GGUF tensor {n} has shape {got}, expected {want} (for {path})")
            pairs.append((t, rows))
        out[path] = pairs
    extra = sorted(set(by_name) - wanted - set(CONFIG_TENSORS))
    if extra:
        raise ValueError(f"GGUF has unexpected tensor(s) {extra[:8]} (of {len(extra)})")
    return out


def gguf_tensor_map(reader: gguf.GGUFReader, config: ModelConfig) -> dict[str, list]:
    """{param path: [ReaderTensor for each stacked layer]} ([one tensor] for the rest): the
    tensors of `gguf_sources` (checked the same way), without their fused-row slices."""
    return {p: [t for t, _ in pairs] for p, pairs in gguf_sources(reader, config).items()}


def tensor_param(path: str, t, rows: slice | None, config: ModelConfig) -> np.ndarray:
    """One GGUF tensor (one layer) -> its param array: dequantized, the param's rows of a fused
    tensor, llama q/k un-permuted, Gemma's (1 + w) norms shifted back, transposed to [in, out]."""
    x = dequantize_tensor(t)  # numpy order: [out, in] for linears, [E, out, in] for experts
    if rows is not None:
        x = x[rows]
    heads = unpermute_heads(path, config)
    if heads is not None:
        x = unpermute_rows(x, heads)
    return gguf_archs.to_param(path, x, config)


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


def load_gguf_params(
    reader: gguf.GGUFReader, config: ModelConfig, dtype: str = "float32", mesh=None
) -> dict:
    """Every mapped tensor through `tensor_param` (dequantized, fused rows split, llama q/k
    un-permuted, Gemma norms shifted, linears transposed to [in, out]), stacked per layer."""
    np_dtype(dtype)  # validate before the slow part
    shapes = flat_shapes(config)
    flat = {}
    for path, pairs in gguf_sources(reader, config).items():
        arr = np.empty(shapes[path], np.float32) if path.startswith("layers/") else None
        for i, (t, rows) in enumerate(pairs):
            x = tensor_param(path, t, rows, config)
            if arr is None:
                arr = np.ascontiguousarray(x)
            else:
                arr[i] = x
        flat[path] = arr
    return to_device(flat, config, dtype, mesh)


def load_gguf(
    path: str | Path, dtype: str = "float32", reader=None, mesh=None
) -> tuple[ModelConfig, dict]:
    """Reads a GGUF file into (config, params). Pass an open `reader` to avoid parsing twice;
    a `mesh` to place each tensor straight onto its shards."""
    reader = reader if reader is not None else open_gguf(path)
    config = read_config(path, reader)
    try:
        params = load_gguf_params(reader, config, dtype, mesh)
    except ModelLoadError:
        raise
    except ValueError as e:  # a tensor's name, shape or type: name the file too
        raise ModelLoadError(path, str(e)) from e
    log.info("loaded %d GGUF tensors from %s (%s)", len(reader.tensors), path, dtype)
    return config, params
