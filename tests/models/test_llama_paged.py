"""The model over the paged cache: cached step-by-step decoding equals the full forward, and the
physical page placement (a shuffled page table) changes nothing."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from model_testing import (
    GOLDEN_DIR,
    forward_logits,
    greedy_generate,
    load_golden_logits,
    model_step,
    sequence_meta,
)

from jaxserve.layers import kv_cache as kvc
from jaxserve.loading import hf


@pytest.fixture(scope="module")
def tiny():
    """The tiny Llama-3.1 golden checkpoint (rope scaling makes positions matter more)."""
    return hf.load_hf_dir(GOLDEN_DIR / "llama31", "float32")


def test_stepwise_decode_equals_full_forward(tiny):
    config, params = tiny
    tokens, _ = load_golden_logits("llama")  # i32[2, 12]
    b, t = tokens.shape
    full = forward_logits(params, config, tokens)  # (B, T, V)
    ps, prefix, per_seq = 4, 5, 4
    pages = [[5, 0, 7, 2], [1, 6, 3, 4]]  # scattered; 3 pages hold 12 tokens, one spare each
    cache = kvc.init(
        config.num_layers,
        config.num_kv_heads,
        b * per_seq,
        ps,
        config.head_dim,
        "auto",
        jnp.float32,
    )
    meta = sequence_meta(pages, [0] * b, [prefix] * b, prefix, ps, per_seq)
    logits, cache = model_step(params, jnp.asarray(tokens[:, :prefix]), meta, cache, config)
    steps = [np.asarray(logits)]
    for pos in range(prefix, t):  # crosses page boundaries at 8
        meta = sequence_meta(pages, [pos] * b, [1] * b, 1, ps, per_seq)
        logits, cache = model_step(
            params, jnp.asarray(tokens[:, pos : pos + 1]), meta, cache, config
        )
        steps.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-5, rtol=0)


def test_shuffled_page_table_gives_identical_results(tiny):
    config, params = tiny
    prompts = [[3, 17, 99, 5, 42, 8, 1], [250, 7], [11, 12, 13, 14, 15]]
    base_tokens, base_logits = greedy_generate(params, config, prompts, 10, page_size=4)
    for seed in (1, 2):
        tokens, logits = greedy_generate(
            params, config, prompts, 10, page_size=4, shuffle_seed=seed
        )
        np.testing.assert_array_equal(tokens, base_tokens)
        for a, b in zip(logits, base_logits):
            np.testing.assert_array_equal(a, b)
