"""Prompt-lookup speculative decoding (`runner/spec_decode.py`): the device proposer against its
plain-Python reference, and engines that speculate against engines that do not (f32: the same
tokens exactly), through stops, length limits, preemption, mixed batches and warm-up."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.bench.core import CompileCounter
from jaxserve.config import EngineConfig
from jaxserve.runner.spec_decode import ngram_propose, ngram_propose_reference

KW = dict(
    load_format="dummy",
    dtype="float32",
    num_slots=8,
    max_model_len=96,
    page_size=8,
    prefill_chunk_size=16,
    max_num_batched_tokens=32,
)
SPEC = dict(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)


@pytest.mark.parametrize("k,min_n,max_n", [(1, 1, 1), (3, 1, 4), (4, 2, 3), (5, 5, 5)])
def test_ngram_propose_equals_the_reference(k, min_n, max_n):
    rng = np.random.default_rng(k * 10 + min_n)
    length, rows = 40, 24
    history = np.full((rows, length), -1, np.int32)
    lens = []
    for b in range(rows):
        n = int(rng.integers(1, length + 1))
        period = int(rng.integers(1, 7))  # loops, as greedy outputs do, with noise
        seq = np.tile(rng.integers(0, 5, period), length)[:n]
        noise = rng.random(n) < 0.15
        seq[noise] = rng.integers(0, 5, int(noise.sum()))
        history[b, :n] = seq
        lens.append(n)
    got = jax.jit(ngram_propose, static_argnums=(2, 3, 4))(
        history, np.array(lens, np.int32), k, min_n, max_n
    )
    for b, n in enumerate(lens):
        want = ngram_propose_reference(history[b, :n].tolist(), k, min_n, max_n)
        assert np.asarray(got[b]).tolist() == want, (b, history[b, :n].tolist())


def _prompts(rng, count):
    return [
        {"prompt_token_ids": np.tile(rng.integers(3, 60, rng.integers(1, 5)), 6)[: 4 + 3 * i]}
        for i in range(count)
    ]


def _ids(outs):
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


@pytest.mark.parametrize(
    "dtype,attention",
    [
        ("float32", "auto"),
        # bf16 through the C++ kernels: the verify tokens run as decode rows, so their bits are
        # a decode step's and the tokens equal plain greedy decoding's exactly
        ("bfloat16", "auto"),
        ("float32", "ragged"),  # the verify tokens as a chunk
    ],
)
def test_speculative_greedy_equals_greedy_through_stops_and_limits(dtype, attention):
    kw = dict(KW, dtype=dtype, attention_impl=attention)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": p["prompt_token_ids"].tolist()} for p in _prompts(rng, 12)]
    params = [
        SamplingParams(temperature=0, max_tokens=5 + 7 * i, ignore_eos=i % 2 == 0)
        for i in range(10)
    ] + [
        SamplingParams(temperature=0, max_tokens=60, stop_token_ids=[7, 11]),
        SamplingParams(temperature=0, max_tokens=1),
    ]
    want = LLM("tiny", **kw).generate(prompts, params, use_tqdm=False)
    for async_scheduling in (True, False):
        llm = LLM("tiny", async_scheduling=async_scheduling, **SPEC, **kw)
        got = llm.generate(prompts, params, use_tqdm=False)
        assert _ids(got) == _ids(want)
        assert [o.outputs[0].finish_reason for o in got] == [
            o.outputs[0].finish_reason for o in want
        ]
        st = llm.stats()
        assert st["num_spec_drafts"] > 0
        assert 0 < st["num_spec_accepted_tokens"] <= st["num_spec_draft_tokens"]
        assert st["num_spec_draft_tokens"] == 3 * st["num_spec_drafts"]
        # every token is a step's accepted drafts or its one token of the target's
        decoded = sum(len(c) - 1 for o in _ids(got) for c in o)
        assert st["num_spec_accepted_tokens"] <= decoded
    # fewer steps than tokens: the drafts were accepted
    assert llm.stats()["num_steps"] < max(len(o.outputs[0].token_ids) for o in want)


def test_a_batch_with_a_sampled_request_decodes_without_speculation_until_it_ends():
    rng = np.random.default_rng(1)
    prompts = [{"prompt_token_ids": p["prompt_token_ids"].tolist()} for p in _prompts(rng, 4)]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True) for _ in range(3)]
    params.append(SamplingParams(temperature=0.9, seed=5, max_tokens=6, ignore_eos=True))
    want = LLM("tiny", **KW).generate(prompts, params, use_tqdm=False)
    llm = LLM("tiny", **SPEC, **KW)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert _ids(got) == _ids(want)
    assert llm.stats()["num_spec_drafts"] > 0  # after the sampled request finished
    # logprobs, penalties and min_tokens keep a request's steps plain
    for sp in (
        SamplingParams(temperature=0, max_tokens=20, logprobs=2),
        SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.5),
        SamplingParams(temperature=0, max_tokens=20, min_tokens=20, stop_token_ids=[5]),
    ):
        before = llm.stats()["num_spec_drafts"]
        a = llm.generate(prompts[0], sp, use_tqdm=False)
        b = LLM("tiny", **KW).generate(prompts[0], sp, use_tqdm=False)
        assert _ids(a) == _ids(b)
        assert llm.stats()["num_spec_drafts"] == before


def test_speculation_survives_preemption_and_the_batch_size_limit():
    rng = np.random.default_rng(2)
    prompts = [{"prompt_token_ids": p["prompt_token_ids"].tolist()} for p in _prompts(rng, 8)]
    params = [SamplingParams(temperature=0, max_tokens=60, ignore_eos=True) for _ in range(8)]
    want = LLM("tiny", **KW).generate(prompts, params, use_tqdm=False)
    small = dict(KW, num_pages=30)  # 8 requests of up to 85 tokens: preemptions
    llm = LLM("tiny", **SPEC, **small)
    assert _ids(llm.generate(prompts, params, use_tqdm=False)) == _ids(want)
    assert llm.stats()["num_preemptions"] > 0 and llm.stats()["num_spec_drafts"] > 0
    # speculating only with at most 2 requests held: the tail of the batch
    capped = LLM("tiny", speculative_disable_by_batch_size=2, **SPEC, **KW)
    assert _ids(capped.generate(prompts, params, use_tqdm=False)) == _ids(want)
    assert 0 < capped.stats()["num_spec_drafts"] < llm.stats()["num_spec_drafts"]


def test_no_recompilation_after_warmup_with_speculation():
    rng = np.random.default_rng(3)
    prompts = [{"prompt_token_ids": p["prompt_token_ids"].tolist()} for p in _prompts(rng, 8)]
    llm = LLM("tiny", warmup=True, speculative_disable_by_batch_size=4, **SPEC, **KW)
    assert len(llm.engine.runner.speculative_shapes()) == 2  # row buckets 1 and 4
    with CompileCounter() as counter:
        for count in (1, 3, 8):
            sps = [
                SamplingParams(temperature=0, max_tokens=10 + 9 * i, ignore_eos=True)
                for i in range(count)
            ]
            llm.generate(prompts[:count], sps, use_tqdm=False)
        llm.generate(prompts[:2], SamplingParams(temperature=0.5, seed=1, max_tokens=8))
    assert counter.count == 0
    assert llm.stats()["num_spec_drafts"] > 0


def test_draft_tokens_follow_the_batch_size_schedule():
    """vLLM's num_speculative_tokens_per_batch_size, k=3 drafts for 1 request, 1 for 2-4, none
    from 5, over row buckets 1, 4, 8: warm-up compiles a program per (bucket, drafts) pair the
    schedule can reach, nothing recompiles, and the tokens are plain greedy decoding's."""
    schedule = [[1, 1, 3], [2, 4, 1], [5, 8, 0]]
    c = EngineConfig(num_speculative_tokens=3, num_speculative_tokens_per_batch_size=schedule)
    assert [c.speculative.draft_tokens(n) for n in (1, 2, 4, 5, 8)] == [3, 1, 1, 0, 0]
    assert EngineConfig(num_speculative_tokens=3).speculative.draft_tokens(32) == 3
    rng = np.random.default_rng(4)
    prompts = [{"prompt_token_ids": p["prompt_token_ids"].tolist()} for p in _prompts(rng, 8)]
    params = [
        SamplingParams(temperature=0, max_tokens=12 + 8 * i, ignore_eos=True) for i in range(8)
    ]
    want = LLM("tiny", **KW).generate(prompts, params, use_tqdm=False)
    llm = LLM("tiny", warmup=True, num_speculative_tokens_per_batch_size=schedule, **SPEC, **KW)
    pairs = llm.engine.runner.speculative_shapes()
    assert sorted({(s.rows, k) for s, k in pairs}) == [(1, 1), (1, 3), (4, 1)]
    with CompileCounter() as counter:
        assert _ids(llm.generate(prompts, params, use_tqdm=False)) == _ids(want)
        assert _ids(llm.generate(prompts[:1], params[:1], use_tqdm=False)) == _ids(want[:1])
    assert counter.count == 0
    st = llm.stats()
    drafts, tokens = st["num_spec_drafts"], st["num_spec_draft_tokens"]
    assert drafts < tokens < 3 * drafts  # rows of 1 and of 3 drafts


def test_speculation_settings_are_checked():
    assert EngineConfig(num_speculative_tokens=2).prompt_lookup_max == 5  # vLLM's defaults
    assert EngineConfig(prompt_lookup_max=3).prompt_lookup_min == 3
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        EngineConfig(prompt_lookup_min=4, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="decode_steps=1"):
        EngineConfig(num_speculative_tokens=2, decode_steps=4)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(num_speculative_tokens=-1)
    with pytest.raises(ValueError, match="num_speculative_tokens_per_batch_size"):
        EngineConfig(num_speculative_tokens=2, num_speculative_tokens_per_batch_size=[[2, 8, 1]])
    with pytest.raises(ValueError, match="needs num_speculative_tokens > 0"):
        EngineConfig(num_speculative_tokens_per_batch_size=[[1, 8, 1]])
    c = EngineConfig(num_speculative_tokens=3, speculative_disable_by_batch_size=4)
    assert [c.speculative.draft_tokens(n) for n in (1, 4, 5)] == [3, 3, 0]


@pytest.mark.smollm2
def test_speculative_greedy_equals_greedy_on_smollm2_in_bf16(smollm2_gguf_path):
    """SmolLM2 bf16, one request at a time, on requests of serve_bench's workload whose outputs a
    chunk-shaped verify forward changes (its bf16 rounding flips near-ties; 4 of the first 24):
    run as decode rows, the verified tokens are plain greedy decoding's, bit for bit."""
    from jaxserve.bench.workloads import make_workload

    reqs = make_workload("longtail-small", 49152, 24, 0).requests
    picked = [reqs[i] for i in (7, 17, 20, 23)]
    prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in picked]
    params = [
        SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in picked
    ]
    kw = dict(model=str(smollm2_gguf_path), dtype="bfloat16", num_slots=1, max_model_len=512)
    want = LLM(**kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(**kw, num_speculative_tokens=3, prompt_lookup_max=4, prompt_lookup_min=1)
    assert _ids(llm.generate(prompts, params, use_tqdm=False)) == _ids(want)
    assert llm.stats()["num_spec_accepted_tokens"] > 0
