"""GGUF Q4_0 / Q4_1 blocks straight into the packed INT4 layout, Q8_0 into INT8: no float round trip.

A GGUF linear weight is stored row by row (a row = one output feature, numpy view [out, in_bytes]),
each row a run of blocks of 32 consecutive inputs:

    Q4_0 (18 bytes): f16 d,          qs[16]   w = d * (q - 8)   -> scale = d, min = -8 d
    Q4_1 (20 bytes): f16 d, f16 m,   qs[16]   w = d * q + m     -> scale = d, min = m
    Q8_0 (34 bytes): f16 d,          i8 qs[32]  w = d * q       -> Int8Weight, g = 32

Element order inside a 4-bit block (ggml's `dequantize_row_q4_*`): the low nibbles of qs[0..15]
are elements 0..15 and the high nibbles elements 16..31, NOT interleaved pairs.

So a 4-bit tensor maps to codes u8[out, in], scales/mins f16[out, in/32] taken bit for bit from
the file; llama.cpp's q/k row permutation is undone on those rows (it only moves whole output
rows, `gguf_file.unpermute_rows`), then they are transposed to our [in, out] and packed with
`int4.pack` at group_size 32. Every weight value is then exactly GGUF's dequantized value.

    import_gguf_params(reader, config, dtype, shards=1) -> params   linears and embed quantized
    load_gguf_native(path, dtype, shards=1)  -> LoadedModel (`load_model(..., quantization="gguf-native")`)

Tensor parallelism: `shards` (an int for every INT4 weight, or a mapping param path -> int, absent
paths 1) packs each INT4 weight's N columns as that many blocks (`pallas_kernels/int4_layout.py`),
so a column-parallel split over T = shards devices gives each device a plain packed weight. It
only moves nibbles: the values are GGUF's either way. A Q8_0 weight (Int8Weight) splits as it is.

Linear weights of any other type (F32, F16, K-quants) are dequantized to `dtype` floats. The token
embedding token_embd (numpy [V, D], blocks along D) is already the lm_head view [D, V] the model
takes a quantized embed in (`layers/embedding.py`): rows = outputs V, blocks along the input D. So
a Q8_0/Q4_0/Q4_1 token_embd imports through the same `import_linear` (SmolLM2: Q8_0 -> Int8Weight
g=32, which then also computes the tied logits), exactly GGUF's dequantized values.

This is loading, not quantization: it reads a file into the layouts `jaxserve.quant` defines
(loading imports quant; quant never imports loading).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import gguf
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.loading import gguf_archs, gguf_file
from jaxserve.loading.loaded import LoadedModel, ModelLoadError
from jaxserve.loading.params import flat_shapes, np_dtype, to_device
from jaxserve.loading.tokenizer import load_tokenizer
from jaxserve.quant import int4
from jaxserve.quant.int8 import Int8Weight

log = logging.getLogger(__name__)

Q = gguf.GGMLQuantizationType
BLOCK = 32
BLOCK_BYTES = {Q.Q4_0: 18, Q.Q4_1: 20, Q.Q8_0: 34}
NATIVE_TYPES = tuple(BLOCK_BYTES)
GGUF_NATIVE = "gguf-native"


def _blocks(raw: np.ndarray, qtype, rows: int, cols: int) -> np.ndarray:
    """A tensor's bytes -> u8[rows, cols/32, block_bytes] (checks type and sizes)."""
    if qtype not in BLOCK_BYTES:
        raise ValueError(
            f"GGUF tensor type {Q(qtype).name} cannot be imported natively; "
            f"supported: {[t.name for t in NATIVE_TYPES]}"
        )
    if cols % BLOCK:
        raise ValueError(f"GGUF row length {cols} is not a multiple of the block size {BLOCK}")
    nb = BLOCK_BYTES[qtype]
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if raw.size != rows * (cols // BLOCK) * nb:
        raise ValueError(
            f"GGUF {Q(qtype).name} data has {raw.size} bytes, expected {rows}x{cols} weights "
            f"= {rows * (cols // BLOCK) * nb} bytes"
        )
    return raw.reshape(rows, cols // BLOCK, nb)


def q4_to_codes(
    raw: np.ndarray, qtype, rows: int, cols: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_0/Q4_1 bytes -> (codes u8[rows, cols], scales f16[rows, cols/32], mins f16[rows, cols/32]).

    rows/cols are numpy order: [out, in] for a linear weight.
    """
    if qtype not in (Q.Q4_0, Q.Q4_1):
        raise ValueError(f"expected a Q4_0 or Q4_1 tensor, got {Q(qtype).name}")
    b = _blocks(raw, qtype, rows, cols)  # (rows, nblk, 18|20)
    d = b[..., 0:2].copy().view(np.float16)[..., 0]  # (rows, nblk)
    if qtype == Q.Q4_1:
        m = b[..., 2:4].copy().view(np.float16)[..., 0]
        qs = b[..., 4:20]
    else:
        if np.any(np.abs(d.astype(np.float32)) * 8 > np.finfo(np.float16).max):
            raise ValueError("Q4_0 scale too large: -8 * d overflows float16")
        m = (d.astype(np.float32) * -8.0).astype(np.float16)  # exact: a power-of-two multiple
        qs = b[..., 2:18]
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=-1)  # (rows, nblk, 32): low nibbles first
    return codes.reshape(rows, cols), d, m


def q8_0_to_int8(raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 bytes -> (q i8[rows, cols], scales f32[rows, cols/32]) in numpy order."""
    b = _blocks(raw, Q.Q8_0, rows, cols)  # (rows, nblk, 34)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = b[..., 2:34].copy().view(np.int8).reshape(rows, cols)
    return q, d


def tensor_rows_cols(t) -> tuple[int, int]:
    """numpy-order (rows, cols) of a 2-D GGUF tensor (GGUF lists dims innermost first)."""
    if len(t.shape) != 2:
        raise ValueError(f"GGUF tensor {t.name} is not 2-D: shape {list(t.shape)}")
    return int(t.shape[1]), int(t.shape[0])


def import_linear(tensors: list, heads: int | None, stacked: bool, shards: int = 1, rows=None):
    """GGUF tensors of one linear param (one per layer) -> Int4Weight / Int8Weight [(L,) in, out].

    heads: undo llama.cpp's q/k row permutation with this many heads (None: not permuted).
    shards: the INT4 weight's column blocks (ignored for Q8_0); N must be a multiple of 8*shards.
    rows: per tensor, the slice of its rows (output features) holding the param (a fused tensor,
    phi3's attn_qkv / ffn_up) or None; whole block rows move, so the values stay GGUF's.
    """
    types = {t.tensor_type for t in tensors}
    if len(types) != 1:
        raise ValueError(f"{tensors[0].name}: layers mix tensor types {[Q(x).name for x in types]}")
    qtype = types.pop()
    if qtype not in NATIVE_TYPES:
        raise ValueError(
            f"GGUF tensor {tensors[0].name} has type {Q(qtype).name}, which cannot be imported "
            f"natively; supported: {[t.name for t in NATIVE_TYPES]}"
        )
    unpermute = (lambda a: gguf_file.unpermute_rows(a, heads)) if heads is not None else None
    parts = []
    for i, t in enumerate(tensors):
        sel = None if rows is None else rows[i]

        def fix(a, sel=sel):
            a = a if sel is None else a[sel]
            return a if unpermute is None else unpermute(a)

        rows_, cols = tensor_rows_cols(t)  # (out, in)
        if qtype == Q.Q8_0:
            q, d = q8_0_to_int8(t.data, rows_, cols)
            parts.append((fix(q).T, fix(d).T))  # (in, out), (in/32, out)
        else:
            codes, d, m = q4_to_codes(t.data, qtype, rows_, cols)
            parts.append((fix(codes).T, fix(d).T, fix(m).T))
    arrays = [np.stack(a) if stacked else a[0] for a in zip(*parts)]
    if qtype == Q.Q8_0:
        q, d = arrays
        return Int8Weight(jnp.asarray(q), jnp.asarray(d), group_size=BLOCK)
    codes, d, m = arrays
    return int4.pack(codes, d, m, group_size=BLOCK, shards=shards)


def import_gguf_params(
    reader, config: ModelConfig, dtype: str = "float32", shards: int | Mapping[str, int] = 1
) -> dict:
    """Params with Q4_0/Q4_1 linears (and token_embd, as the [D, V] lm_head view) as Int4Weight
    (g=32, packed with `shards` column blocks: an int, or param path -> int), Q8_0 ones as
    Int8Weight (g=32); everything else float."""
    shards_of = _shards_of(shards, config)
    dt = np_dtype(dtype)
    floats, quantized = {}, {}
    for path, pairs in gguf_file.gguf_sources(reader, config).items():
        tensors, rows = [t for t, _ in pairs], [r for _, r in pairs]
        stacked = path.startswith("layers/")
        # 2-D linears (not the MoE router, kept float; 3-D expert stacks import as floats)
        is_linear = gguf_archs.param_kind(path) == "linear" and path != "layers/router"
        if (is_linear or _native_embed(path, tensors, config, shards_of(path))) and (
            tensors[0].tensor_type in NATIVE_TYPES
        ):
            heads = gguf_file.unpermute_heads(path, config)
            try:
                quantized[path] = import_linear(tensors, heads, stacked, shards_of(path), rows)
            except ValueError as e:
                raise ValueError(f"GGUF weight {path}: {e}") from e
            continue
        arrs = [gguf_file.tensor_param(path, t, r, config) for t, r in pairs]
        floats[path] = (np.stack(arrs) if stacked else arrs[0]).astype(dt)
    params = to_device({**floats, **quantized}, config)  # nests and checks every shape
    log.info(
        "imported %d GGUF linear params natively (%s), %d as floats",
        len(quantized),
        sorted({type(w).__name__ for w in quantized.values()}),
        len(floats),
    )
    return params


def _shards_of(shards, config: ModelConfig):
    """int | {param path: int} -> path -> int; unknown paths in the mapping are errors."""
    if isinstance(shards, Mapping):
        unknown = sorted(set(shards) - set(flat_shapes(config)))
        if unknown:
            raise ValueError(f"shards names unknown param path(s) {unknown}")
        return lambda path: shards.get(path, 1)
    return lambda path: shards


def _native_embed(path: str, tensors: list, config: ModelConfig, shards: int = 1) -> bool:
    """token_embd imports as a quantized lm_head view unless INT4 cannot pack its V columns (in
    `shards` blocks)."""
    if path != "embed":
        return False
    return tensors[0].tensor_type == Q.Q8_0 or config.vocab_size % (int4.PACK * shards) == 0


def load_gguf_native(
    path: Path, dtype: str = "float32", shards: int | Mapping[str, int] = 1
) -> LoadedModel:
    """A .gguf file with its Q4_0/Q4_1/Q8_0 linears imported natively, the rest as `dtype` floats;
    INT4 weights packed with `shards` column blocks (see `import_gguf_params`)."""
    if path.suffix != ".gguf" or not path.is_file():
        raise ValueError(f"quantization={GGUF_NATIVE!r} needs a .gguf file, got {str(path)!r}")
    reader = gguf_file.open_gguf(path)
    config = gguf_file.read_config(path, reader)
    try:
        params = import_gguf_params(reader, config, dtype, shards)
    except ModelLoadError:
        raise
    except ValueError as e:  # a tensor's name, shape or type: name the file too
        raise ModelLoadError(path, str(e)) from e
    return LoadedModel(config, params, load_tokenizer(path, reader=reader), str(path))
