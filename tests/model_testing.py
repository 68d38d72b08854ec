"""Test helpers for model and loader tests: paged-cache metadata, a jitted step, a greedy loop.

The greedy loop is a deliberately small stand-in for the engine (prefill the whole prompt in one
padded call, then decode one token per call, each sequence in its own pages) so model tests do
not depend on the scheduler. Import it as `from model_testing import ...` (tests/ is on sys.path
through tests/conftest.py).
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.layers import kv_cache as kvc
from jaxserve.layers.attention import AttentionMetadata
from jaxserve.models import llama

GOLDEN_DIR = Path(__file__).parent / "golden"


def sequence_meta(
    pages: list[list[int]],
    starts: list[int],
    num_new: list[int],
    t: int,
    page_size: int,
    width: int,
) -> AttentionMetadata:
    """Metadata for B sequences, each stored contiguously (in position order) in its own pages.

    Row b already holds starts[b] tokens and appends num_new[b] <= t new ones (the rest of its
    t columns are padding: slot -1). pages[b] lists its pages in position order; the page table
    row is that list padded with page 0 to `width` pages.
    """
    b = len(pages)
    positions = np.zeros((b, t), np.int32)
    slots = np.full((b, t), -1, np.int32)
    table = np.zeros((b, width), np.int32)
    for i in range(b):
        if len(pages[i]) > width or (starts[i] + num_new[i]) > len(pages[i]) * page_size:
            raise ValueError(f"row {i}: {starts[i] + num_new[i]} tokens do not fit its pages")
        table[i, : len(pages[i])] = pages[i]
        pos = starts[i] + np.arange(t)
        positions[i] = pos
        n = num_new[i]
        slots[i, :n] = table[i, pos[:n] // page_size] * page_size + pos[:n] % page_size
    return AttentionMetadata(
        positions=jnp.asarray(positions),
        slot_mapping=jnp.asarray(slots),
        page_table=jnp.asarray(table),
        seq_lens=jnp.asarray(np.asarray(starts) + np.asarray(num_new), dtype=jnp.int32),
    )


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("cache",))
def model_step(params, tokens, meta, cache, config: ModelConfig):
    """tokens i32[B, T] -> (f32 logits [B, T, V], cache): one forward over the paged cache."""
    hidden, cache = llama.forward(params, tokens, meta, cache, config)
    return llama.compute_logits(params, hidden, config), cache


def forward_logits(params, config, tokens: np.ndarray, page_size: int = 8) -> np.ndarray:
    """Full-sequence forward of tokens i32[B, T] over a fresh paged cache -> f32 logits [B, T, V]."""
    b, t = tokens.shape
    per_seq = -(-t // page_size)
    pages = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(b)]
    cache = kvc.init(
        config.num_layers,
        config.num_kv_heads,
        b * per_seq,
        page_size,
        config.head_dim,
        "auto",
        llama.model_dtype(params),
    )
    meta = sequence_meta(pages, [0] * b, [t] * b, t, page_size, per_seq)
    logits, _ = model_step(params, tokens, meta, cache, config)
    return np.asarray(logits)


def assign_pages(
    num_seqs: int, pages_per_seq: int, shuffle_seed: int | None = None
) -> list[list[int]]:
    """Pages for each sequence: consecutive ids, or a random permutation of the pool when seeded."""
    ids = np.arange(num_seqs * pages_per_seq)
    if shuffle_seed is not None:
        ids = np.random.default_rng(shuffle_seed).permutation(ids)
    return [ids[i * pages_per_seq : (i + 1) * pages_per_seq].tolist() for i in range(num_seqs)]


def greedy_generate(
    params,
    config: ModelConfig,
    prompts: list[list[int]],
    max_new_tokens: int,
    page_size: int = 16,
    shuffle_seed: int | None = None,
    kv_cache_dtype: str = "auto",
) -> tuple[np.ndarray, list[np.ndarray]]:
    """Greedy decoding of a batch of prompts over the paged cache.

    Returns (tokens i32[B, max_new_tokens], [f32 logits [B, V] that chose each token]).
    The prefill is padded to the next power of two so prompt lengths do not recompile.
    """
    b = len(prompts)
    lens = [len(p) for p in prompts]
    t = 1 << (max(lens) - 1).bit_length()
    total = max(lens) + max_new_tokens
    per_seq = -(-total // page_size)
    width = 1 << (per_seq - 1).bit_length()
    pages = assign_pages(b, per_seq, shuffle_seed)
    dtype = llama.model_dtype(params)
    cache = kvc.init(
        config.num_layers,
        config.num_kv_heads,
        b * per_seq,
        page_size,
        config.head_dim,
        kv_cache_dtype,
        dtype,
    )
    tokens = np.zeros((b, t), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    meta = sequence_meta(pages, [0] * b, lens, t, page_size, width)
    logits, cache = model_step(params, jnp.asarray(tokens), meta, cache, config)
    last = np.asarray(logits)[np.arange(b), np.asarray(lens) - 1]  # (B, V)
    out, step_logits = [], []
    for step in range(max_new_tokens):
        nxt = last.argmax(-1).astype(np.int32)  # (B,)
        out.append(nxt)
        step_logits.append(last)
        if step == max_new_tokens - 1:
            break
        starts = [n + step for n in lens]
        meta = sequence_meta(pages, starts, [1] * b, 1, page_size, width)
        logits, cache = model_step(params, jnp.asarray(nxt[:, None]), meta, cache, config)
        last = np.asarray(logits)[:, 0]
    return np.stack(out, axis=1), step_logits


def load_golden_logits(name: str) -> tuple[np.ndarray, np.ndarray]:
    """(tokens i32[2, 12], HF f32 logits [2, 12, V]) of the tiny golden checkpoint `name`."""
    data = np.load(GOLDEN_DIR / name / "logits.npz")
    return data["tokens"], data["logits"]
