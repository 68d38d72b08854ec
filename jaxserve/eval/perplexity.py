"""Perplexity of a model on a token stream, over non-overlapping windows.

    perplexity(params, config, token_ids, window=512, batch=1) -> {"ppl", "tokens", "window", "nll"}

Dataflow: token_ids [n] are cut into ceil(n / window) windows (the last may be shorter). Each
window is one row of a batch [B, window] that runs through the model's own `forward` from
position 0 over a contiguous page layout (row b owns pages b*P .. b*P + P - 1, P = window /
page_size), so the paged cache, its dtype and the attention implementation are the serving ones.
Within a window, token t+1 is scored from the logits at t; the first token of every window is
context only. Padding rows/tokens (the last batch, the short last window) have seq_len 0 / slot -1
and are masked out of the sum:

    nll = -sum log softmax(logits[b, t])[tokens[b, t + 1]]     ppl = exp(nll / tokens)
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.layers import kv_cache as kvc
from jaxserve.layers.attention import AttentionMetadata
from jaxserve.models import llama
from jaxserve.resolve import ModelImpl


@functools.partial(jax.jit, static_argnames=("config", "attn_impl"), donate_argnames=("cache",))
def _window_nll(params, tokens, lens, meta, cache, config, attn_impl):
    """tokens i32[B, T], lens i32[B] -> (nll f32[], scored tokens i32[], cache)."""
    impl = ModelImpl(attention=attn_impl)
    hidden, cache = llama.forward(params, tokens, meta, cache, config, impl)
    logits = llama.compute_logits(params, hidden[:, :-1], config, impl)  # (B, T-1, V) f32
    target = tokens[:, 1:]  # (B, T-1)
    picked = jnp.take_along_axis(logits, target[..., None], axis=-1)[..., 0]
    nll = jax.nn.logsumexp(logits, axis=-1) - picked  # (B, T-1)
    mask = jnp.arange(1, tokens.shape[1])[None, :] < lens[:, None]  # target position < len
    return jnp.sum(jnp.where(mask, nll, 0.0)), jnp.sum(mask), cache


def perplexity(
    params: dict,
    config: ModelConfig,
    token_ids,
    window: int = 512,
    batch: int = 1,
    kv_cache_dtype: str = "auto",
    attn_impl: str = "reference",
    page_size: int = 16,
) -> dict:
    """Perplexity of token_ids (int[n]) under the model; see the module docstring."""
    ids = np.asarray(token_ids)
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise ValueError(f"token_ids must be a 1-D int sequence, got {ids.dtype}{ids.shape}")
    if len(ids) < 2:
        raise ValueError(f"token_ids needs at least 2 tokens, got {len(ids)}")
    if ids.min() < 0 or ids.max() >= config.vocab_size:
        raise ValueError(f"token_ids must lie in [0, {config.vocab_size})")
    if window < 2:
        raise ValueError(f"window must be >= 2, got {window}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two, got {page_size}")
    n_win = math.ceil(len(ids) / window)
    n_rows = math.ceil(n_win / batch) * batch
    toks = np.zeros((n_rows, window), np.int32)
    lens = np.zeros((n_rows,), np.int32)
    for w in range(n_win):
        chunk = ids[w * window : (w + 1) * window]
        toks[w, : len(chunk)] = chunk
        lens[w] = len(chunk)

    ppr = math.ceil(window / page_size)  # pages per row
    dtype = llama.model_dtype(params)
    cache = kvc.init(
        config.num_layers,
        config.num_kv_heads,
        batch * ppr,
        page_size,
        config.head_dim,
        kv_cache_dtype,
        dtype,
    )
    total, count = 0.0, 0
    for s in range(0, n_rows, batch):
        bl = lens[s : s + batch]
        meta = AttentionMetadata.contiguous(bl, window, page_size)  # row b in pages b * ppr ...
        nll, cnt, cache = _window_nll(
            params,
            jnp.asarray(toks[s : s + batch]),
            jnp.asarray(bl),
            meta,
            cache,
            config,
            attn_impl,
        )
        total += float(nll)
        count += int(cnt)
    return {"ppl": math.exp(total / count), "tokens": count, "window": window, "nll": total}
