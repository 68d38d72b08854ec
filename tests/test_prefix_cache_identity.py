"""Issue 24, "outputs depend only on the request": in bf16, a prefix-cache hit changes no token and
no log-prob. Three ways to hit: a shared system prompt, the children of an n > 1 request, a chat's
next turn (whose prompt holds the previous answer).

The model is the tiny preset widened to SmolLM2's layer sizes (576 hidden, 1536 MLP, 64-dim heads),
4 layers, dummy weights (the tiny model's outputs were identical even with the old code). Before
only prefill-computed pages were cached, a next turn took the answer's pages, whose K/V decode
steps wrote, and its log-probs differed from an uncached run's from the first token on in 2 of the
4 turns below (SmolLM2 itself: 32 of 64 follow-up answers differed in a 32-chat benchmark).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config.model import ModelConfig

CONFIG = dataclasses.replace(
    ModelConfig.preset("tiny"),
    hidden_size=576,
    intermediate_size=1536,
    num_layers=4,
    head_dim=64,
    name="tiny-wide",
)
KW = dict(
    load_format="dummy",
    dtype="bfloat16",
    num_slots=4,
    max_model_len=128,
    page_size=16,
    prefill_chunk_size=32,
    max_num_batched_tokens=64,
)


@pytest.fixture(scope="module")
def llms():
    return LLM(CONFIG, **KW), LLM(CONFIG, enable_prefix_caching=True, **KW)


def outputs(llm, prompts, sp):
    """(token ids, log-prob of each token) of every completion, and the cached prompt tokens."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    got = [
        (c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
        for o in outs
        for c in o.outputs
    ]
    return got, [o.num_cached_tokens for o in outs]


def test_a_next_turn_that_hits_the_previous_prompt_gives_the_uncached_outputs(llms):
    off, on = llms
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
    rng = np.random.default_rng(0)
    for _ in range(4):
        assert on.reset_prefix_cache()
        first = rng.integers(3, 128, 20).tolist()  # one full page of prompt, then 4 tokens
        answer = outputs(on, [first], sp)[0][0][0]
        second = first + answer + [7, 8, 9]  # pages 1..3 hold answer tokens decode steps wrote
        want, _ = outputs(off, [second], sp)
        got, cached = outputs(on, [second], sp)
        assert got == want
        assert cached == [16]  # the first prompt's page only, never a page decode steps wrote


def test_a_shared_system_prompt_and_n_children_give_the_uncached_outputs(llms):
    off, on = llms
    assert on.reset_prefix_cache()
    rng = np.random.default_rng(1)
    system = rng.integers(3, 128, 70).tolist()  # 4 full pages: hits end off the 32-token grid
    rows = [system + rng.integers(3, 128, int(k)).tolist() for k in (3, 9, 17, 30, 5, 12)]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    want, _ = outputs(off, rows, greedy)
    got, cached = outputs(on, rows, greedy)  # 4 slots: the later rows are admitted after a hit
    assert sum(c > 0 for c in cached) >= 2 and got == want
    assert [outputs(off, [r], greedy)[0][0] for r in rows] == want  # each alone: the same
    assert on.reset_prefix_cache()
    sampled = SamplingParams(n=3, temperature=1, seed=5, max_tokens=24, ignore_eos=True, logprobs=1)
    want, _ = outputs(off, [system + [4, 5]], sampled)
    got, cached = outputs(on, [system + [4, 5]], sampled)
    assert cached == [2 * 64] and got == want  # children 1, 2 share child 0's prompt pages
