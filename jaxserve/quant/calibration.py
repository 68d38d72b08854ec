"""Calibration for AWQ and GPTQ: offline text -> token windows -> per-layer linear-input statistics.

Dataflow (host loop over layers, each layer one jitted f32 call per minibatch of windows):

    calibration_text(source)                 "pydoc": Python's own docs (`pydoc_data.topics`),
                                             ~490k chars (the default); "gnu-info": Debian's GNU
                                             info manuals, ~4 M chars (opt-in, for a mix)
      -> calibration_tokens(tokenizer, n, T,  i32[N, T]   evenly spaced windows of each source's
                            sources=...)                  token stream, sources interleaved
      -> x = embed[tokens]                    f32[N, T, D]
      -> for each layer i:
           layer_forward(layer_i, x)          x' [N, T, D] plus the input of every linear:
               "attn" [N, T, D]    rms_norm(x)        -> wq, wk, wv
               "o"    [N, T, H*Dh] attention output   -> wo
               "mlp"  [N, T, D]    rms_norm(x + attn) -> w_gate, w_up
               "down" [N, T, I]    silu(gate) * up    -> w_down
           accumulated into LayerStats: hessian[name] f32[in, in] = X^T X / n, absmean[name] f32[in]
           x = x'  (from the float layer, or from the layer after quantization: `sequential_quantize`)

The layer math is the model's (`jaxserve.models.llama`): the same rms_norm, rope and linear; only
attention is a dense causal softmax over each whole window instead of the paged cache, which is the
same function for a prompt that starts at position 0. Statistics are tiny next to activations
(X^T X is [in, in]), so all 30 layers of SmolLM2 fit in ~0.4 GB and several group sizes can share them.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import logging
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.models import llama
from jaxserve.quant import int4, rtn

log = logging.getLogger(__name__)

CALIBRATION_SOURCES = {
    "pydoc": "Python stdlib pydoc_data.topics (the Python language reference topics)",
    "gnu-info": "Debian's GNU info manuals (/usr/share/info: coreutils, grep, sed, find, wget, ...; "
    "license, copying and index nodes left out)",
}
CALIBRATION_SOURCE = CALIBRATION_SOURCES["pydoc"]  # the default
INFO_DIR = "/usr/share/info"
# Info nodes that are not manual prose: license texts and the Top nodes' copyright notices (kept
# out so that the evaluation text, the GPL-3 license, is not in the calibration set) and indexes.
_SKIPPED_INFO_NODE = re.compile(r"licen[cs]e|copying|index|\bL?GPL\b|\bG?FDL\b|^Top$", re.I)
LINEAR_INPUTS = {
    "attn": ("wq", "wk", "wv"),
    "o": ("wo",),
    "mlp": ("w_gate", "w_up"),
    "down": ("w_down",),
}


def calibration_text(source: str = "pydoc") -> str:
    """One calibration corpus by name (CALIBRATION_SOURCES).

    "pydoc": every topic of the stdlib's `pydoc_data.topics`, in sorted order.
    "gnu-info": the prose of every GNU info manual Debian installs under /usr/share/info, node by
    node, without the info headers and without the Top (copyright notice), license, copying and
    index nodes.
    """
    if source == "pydoc":
        from pydoc_data import topics

        return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    describe_sources([source])  # raises on an unknown name
    return _gnu_info_text(INFO_DIR)


def _gnu_info_text(info_dir: str) -> str:
    from pathlib import Path

    files = sorted(Path(info_dir).glob("*.info*.gz"))
    nodes = []
    for f in files:
        raw = gzip.decompress(f.read_bytes()).decode("utf-8", errors="replace")
        for chunk in raw.split("\x1f")[1:]:  # [0] is the preamble (copyright, dir entry)
            header, _, body = chunk.lstrip("\n").partition("\n")
            m = re.search(r"Node: ([^,\n]+)", header)
            if not header.startswith("File:") or m is None or _SKIPPED_INFO_NODE.search(m[1]):
                continue  # tag tables, indirect tables, license/copying/index nodes
            nodes.append(body.strip("\n"))
    if not nodes:
        raise ValueError(f"calibration source 'gnu-info' found no info manuals in {info_dir}")
    return "\n\n".join(nodes)


def describe_sources(sources: tuple[str, ...] | list[str]) -> str:
    """The recipe's text for a list of calibration sources."""
    for s in sources:
        if s not in CALIBRATION_SOURCES:
            raise ValueError(
                f"unknown calibration source {s!r}; choose from {sorted(CALIBRATION_SOURCES)}"
            )
    return " + ".join(CALIBRATION_SOURCES[s] for s in sources)


def calibration_tokens(
    tokenizer, num_tokens: int = 8192, seqlen: int = 512, text=None, sources=("pydoc",)
) -> np.ndarray:
    """Tokenizes the calibration text into i32[num_tokens // seqlen, seqlen].

    `text` if given, else the named `sources` (CALIBRATION_SOURCES), which share the windows
    equally (the first ones get one more when they do not divide) and are interleaved window by
    window. Within a text, windows are spread evenly over its whole token stream, so they cover
    many topics.
    """
    if seqlen <= 0 or num_tokens < seqlen:
        raise ValueError(
            f"calibration needs num_tokens >= seqlen > 0, got num_tokens={num_tokens}, seqlen={seqlen}"
        )
    n = num_tokens // seqlen
    if text is not None:
        return _windows(tokenizer, text, n, seqlen)
    sources = list(sources)
    describe_sources(sources)  # validates the names
    if not sources or len(sources) > n:
        raise ValueError(
            f"calibration needs 1 to {n} sources for {n} windows, got {len(sources)}: {sources}"
        )
    per = [n // len(sources) + (i < n % len(sources)) for i in range(len(sources))]
    parts = [_windows(tokenizer, calibration_text(s), k, seqlen) for s, k in zip(sources, per)]
    order = sorted(
        ((j, i) for i, k in enumerate(per) for j in range(k))
    )  # window j of every source, then window j + 1: interleaved
    return np.stack([parts[i][j] for j, i in order])


def _windows(tokenizer, text: str, n: int, seqlen: int) -> np.ndarray:
    ids = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], np.int32)
    if len(ids) < n * seqlen:
        raise ValueError(
            f"calibration text has {len(ids)} tokens, fewer than num_tokens={n * seqlen}"
        )
    starts = np.linspace(0, len(ids) - seqlen, n).astype(np.int64)
    return np.stack([ids[s : s + seqlen] for s in starts])


def group_size_for(name: str, k: int, group_size: int, allow_smaller: bool = False) -> int:
    """The INT4 group size for a weight with input dim k.

    group_size must divide k, else ValueError naming the weight; with allow_smaller the largest
    supported smaller group that divides k is used instead (SmolLM2's 576-wide inputs at g128 -> 64).
    """
    if group_size not in int4.GROUP_SIZES:
        raise ValueError(f"group_size must be one of {int4.GROUP_SIZES}, got {group_size}")
    if k % group_size == 0:
        return group_size
    if allow_smaller:
        for g in sorted(int4.GROUP_SIZES, reverse=True):
            if g < group_size and k % g == 0:
                return g
    raise ValueError(f"group_size {group_size} does not divide the input dim {k} of {name}")


@dataclasses.dataclass
class LayerStats:
    """Second moments of the inputs of one layer's linears (host numpy, f32)."""

    hessian: dict[str, np.ndarray]  # name -> f32[in, in]  X^T X / n
    absmean: dict[str, np.ndarray]  # name -> f32[in]      mean |x| per input channel
    count: int  # tokens seen


def _causal_attention(q, k, v, config: ModelConfig, window=None):
    """Dense causal GQA attention over whole windows (the `attend` of `llama.decoder_layer`).
    q [N, T, H, Dh], k/v [N, T, KVH, Dh] -> ([N, T, H, Dh], None). With the paged attention's
    options (`llama.attention_options`): window i32[] (keys t - p < window; <= 0 global), the
    scores' scale and soft-cap."""
    n, t, h, dh = q.shape
    kvh, g = config.num_kv_heads, config.q_per_kv
    qg = q.reshape(n, t, kvh, g, dh)  # head h = kv * G + g, as in the paged reference
    scale = config.attention_scale or 1.0 / float(np.sqrt(dh))
    s = jnp.einsum("ntkgd,nskd->nkgts", qg, k) * jnp.float32(scale)
    if config.attn_logit_softcap is not None:
        cap = config.attn_logit_softcap
        s = cap * jnp.tanh(s / cap)
    dist = jnp.arange(t)[:, None] - jnp.arange(t)[None, :]  # (T, T): query t - key p
    mask = dist >= 0
    if window is not None:
        mask = mask & ((window <= 0) | (dist < window))
    p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
    return jnp.einsum("nkgts,nskd->ntkgd", p, v).reshape(n, t, h, dh), None


@functools.partial(jax.jit, static_argnames=("config",))
def layer_forward(
    lp: dict, x: jax.Array, config: ModelConfig, layer=None
) -> tuple[jax.Array, dict]:
    """One decoder layer (the model's own, `llama.decoder_layer`) in f32 over whole windows.
    lp: that layer's params (no layer axis); x f32[N, T, D]; layer: its index (traced, so one
    compile serves every layer), needed where windows or RoPE differ per layer (Gemma).

    Returns (x_out f32[N, T, D], {"attn", "o", "mlp", "down"} -> the linears' inputs).
    """
    n, t, _ = x.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (n, t))
    window, inv_freq = None, None
    if layer is not None:
        consts = llama.layer_constants(config)
        window = jnp.asarray(consts["window"])[layer] if config.uses_sliding_window else None
        inv_freq = jnp.asarray(consts["inv_freq"])[layer]
    elif len(set(config.layer_windows().tolist())) > 1:
        raise ValueError("this config's windows differ per layer: pass layer_forward layer=")
    elif config.uses_sliding_window:
        window = jnp.asarray(config.layer_windows()[0])
    attend = functools.partial(_causal_attention, config=config, window=window)
    x, _, taps = llama.decoder_layer(lp, x, positions, attend, config, inv_freq=inv_freq)
    return x, {k: taps[k] for k in LINEAR_INPUTS}


@jax.jit
def _moments(inputs: dict) -> tuple[dict, dict]:
    flat = {k: v.reshape(-1, v.shape[-1]) for k, v in inputs.items()}
    hp = jax.lax.Precision.HIGHEST
    xtx = {k: jnp.einsum("ni,nj->ij", v, v, precision=hp) for k, v in flat.items()}
    return xtx, {k: jnp.sum(jnp.abs(v), axis=0) for k, v in flat.items()}


def layer_slice(params: dict, i: int, dtype=jnp.float32) -> dict:
    """Layer i's params without the layer axis; plain float arrays cast to `dtype`, quantized
    weights sliced as stored."""
    return _layer_slice(params["layers"], jnp.int32(i), jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnums=(2,))
def _layer_slice(layers: dict, i: jax.Array, dtype) -> dict:
    out = {}
    for k, v in layers.items():
        if isinstance(v, jax.Array):
            v = v[i]
            out[k] = v.astype(dtype) if jnp.issubdtype(v.dtype, jnp.floating) else v
        else:
            out[k] = jax.tree_util.tree_map(lambda a: a[i], v)
    return out


def _run_layer(lp, x, config, batch, want_stats, layer=None):
    """Runs one layer over x [N, T, D] in minibatches; optionally accumulates LayerStats."""
    outs, xtx, absum = [], None, None
    layer = None if layer is None else jnp.int32(layer)
    for s in range(0, x.shape[0], batch):
        y, inputs = layer_forward(lp, x[s : s + batch], config, layer)
        outs.append(y)
        if want_stats:
            a, b = _moments(inputs)
            xtx = a if xtx is None else jax.tree_util.tree_map(jnp.add, xtx, a)
            absum = b if absum is None else jax.tree_util.tree_map(jnp.add, absum, b)
    stats = None
    if want_stats:
        n = x.shape[0] * x.shape[1]
        stats = LayerStats(
            hessian={k: np.asarray(v) / n for k, v in xtx.items()},
            absmean={k: np.asarray(v) / n for k, v in absum.items()},
            count=n,
        )
    return jnp.concatenate(outs), stats


def _embed(params: dict, tokens: np.ndarray, config: ModelConfig) -> jax.Array:
    if tokens.ndim != 2 or tokens.dtype.kind not in "iu":
        raise ValueError(f"calibration tokens must be int[N, T], got {tokens.dtype}{tokens.shape}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= config.vocab_size):
        raise ValueError(f"calibration tokens must lie in [0, {config.vocab_size})")
    return llama.embed_tokens(params, jnp.asarray(tokens), config, jnp.float32)  # (N, T, D)


def collect_stats(params: dict, config: ModelConfig, tokens: np.ndarray, batch: int = 4):
    """Statistics of every layer's linear inputs, propagating the float model. -> list[LayerStats]."""
    x = _embed(params, tokens, config)
    stats = []
    for i in range(config.num_layers):
        x, st = _run_layer(layer_slice(params, i), x, config, batch, True, i)
        stats.append(st)
        log.info("calibration stats: layer %d/%d", i + 1, config.num_layers)
    return stats


def sequential_quantize(
    params: dict,
    config: ModelConfig,
    tokens: np.ndarray,
    quantize_layer: Callable[[dict, LayerStats, int], dict],
    batch: int = 4,
    refine: Callable[[dict, jax.Array, jax.Array, int], dict] | None = None,
    holdout: int = 0,
) -> dict:
    """Quantizes layer by layer; each layer is calibrated on the output of the already-quantized
    layers before it (GPTQ's order). quantize_layer(lp f32 dict, stats, i) -> new lp.

    refine(qlp, x_q, y_f, i) -> qlp, if given, runs after each layer's quantization with that
    layer's quantized-prefix input x_q and the FLOAT model's output of the layer y_f [N, T, D]
    (the float activations are propagated alongside; `refine.sequential_refine`).

    holdout: the last `holdout` windows of `tokens` are propagated (refine sees them) but left out
    of the statistics quantize_layer gets (the refinement's held-out windows).

    Returns params with "layers" restacked from the new per-layer params (float leaves cast back
    to the input params' dtype).
    """
    x = x_f = _embed(params, tokens, config)
    n_fit = tokens.shape[0] - holdout
    if holdout < 0 or n_fit < 1:
        raise ValueError(f"holdout={holdout} leaves no calibration window of {tokens.shape[0]}")
    new_layers = []
    for i in range(config.num_layers):
        lp = layer_slice(params, i)
        _, st = _run_layer(lp, x[:n_fit], config, batch, True, i)
        qlp = quantize_layer(lp, st, i)
        if refine is not None:
            x_f, _ = _run_layer(lp, x_f, config, batch, False, i)
            qlp = refine(qlp, x, x_f, i)
        x, _ = _run_layer(float_view(qlp), x, config, batch, False, i)
        new_layers.append(qlp)
        log.info("sequential quantization: layer %d/%d", i + 1, config.num_layers)
    return restack(params, new_layers)


@jax.jit
def float_view(lp: dict) -> dict:
    """Quantized leaves (anything with `.dequantize()`) replaced by their f32 dequantization, so
    propagation is the same math on every backend whatever the weight's matmul kernel."""
    return {k: v if isinstance(v, jax.Array) else v.dequantize() for k, v in lp.items()}


# One compiled program per weight shape instead of a dozen eager ops (codes are in 0..15 by
# construction, so pack's host-side range check has nothing to catch here).
pack_int4 = jax.jit(int4.pack, static_argnames=("group_size", "impl"))


@jax.jit
def _stack_jit(layers: list[dict]) -> dict:
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *layers)


def _stack(layers: list[dict]) -> dict:
    return _stack_jit(list(layers))


def restack(params: dict, layers: list[dict]) -> dict:
    """params with "layers" replaced by the stacked per-layer dicts; float leaves in params' dtype."""
    dtype = params["layers"]["attn_norm"].dtype

    def cast(new, old):
        if isinstance(new, jax.Array) and jnp.issubdtype(new.dtype, jnp.floating):
            return new.astype(old.dtype if isinstance(old, jax.Array) else dtype)
        return new

    stacked = _stack(layers)
    out = dict(params)
    out["layers"] = {
        k: cast(v, params["layers"].get(k)) if isinstance(v, jax.Array) else v
        for k, v in stacked.items()
    }
    return out


def quantize_lm_head(params: dict, config: ModelConfig, group_size: int, allow_smaller=False):
    """An untied lm_head [D, V] -> asymmetric RTN Int4Weight (the calibrated methods cover layers)."""
    if config.tie_word_embeddings:
        return params
    w = params["lm_head"]
    g = group_size_for("lm_head", w.shape[0], group_size, allow_smaller)
    return {**params, "lm_head": rtn.quantize_int4_rtn(w, g, symmetric=False)}
