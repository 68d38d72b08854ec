"""`LLM` end to end on the tiny dummy model: reference equality, batch invariance, preemption,
per-prompt errors, streaming, iter_generate, n > 1, log-probs, static batching, argument checks
(EngineConfig's fields, model-dependent defaults filled).

All LLMs here share one shape configuration (so the jit caches are shared across them) except the
small-KV-pool one used for preemption.
"""

from __future__ import annotations

import numpy as np
import pytest
from model_testing import forward_logits, greedy_generate

from jaxserve import LLM, SamplingParams

KW = dict(
    load_format="dummy",
    dtype="float32",
    num_slots=32,
    max_model_len=64,
    page_size=32,  # two pages per sequence: widths {1, 2}, few compilations
    prefill_chunk_size=16,
    max_num_batched_tokens=32,
)


def make_llm(**kw):
    return LLM("tiny", **{**KW, **kw})


@pytest.fixture(scope="module")
def llm():
    return make_llm()


def prompts(n, seed=0, lo=3, hi=40):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 128, rng.integers(lo, hi)).tolist() for _ in range(n)]


def ids(ps):
    return [{"prompt_token_ids": p} for p in ps]


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_equals_one_shot_reference_loop(llm):
    # 37 and 30 token prompts take 3 and 2 chunks of 16; the reference prefills in one call.
    ps = [[5, 6, 7], list(range(3, 40)), list(range(50, 80)), [9]]
    outs = llm.generate(
        ids(ps), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )
    ref, _ = greedy_generate(llm.engine.runner.params, llm.model_config, ps, 12)
    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == ref[i].tolist()
        assert out.outputs[0].finish_reason == "length"


def test_chunked_prefill_logprobs_equal_one_shot_forward(llm):
    p = list(range(3, 40))  # 3 chunks
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    out = llm.generate(ids([p]), sp, use_tqdm=False)[0]
    seq = p + out.outputs[0].token_ids
    logits = forward_logits(llm.engine.runner.params, llm.model_config, np.array([seq], np.int32))
    x = logits[0] - logits[0].max(-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(-1, keepdims=True))  # (T, V) log_softmax
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(p)
    for t in range(1, len(p)):
        entry = out.prompt_logprobs[t]
        assert entry[p[t]] == pytest.approx(logp[t - 1, p[t]], abs=1e-4)
        assert 1 <= len(entry) <= 2
    for j, tok in enumerate(out.outputs[0].token_ids):
        entry = out.outputs[0].logprobs[j]
        assert entry[tok] == pytest.approx(logp[len(p) - 1 + j, tok], abs=1e-4)
        assert max(entry.values()) == pytest.approx(logp[len(p) - 1 + j].max(), abs=1e-4)


def test_batch_invariance_any_slot(llm):
    target = [17, 3, 99, 42, 8, 77]
    others = prompts(31, seed=1)
    for sp in (
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
        SamplingParams(
            temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=10, ignore_eos=True
        ),
    ):
        alone = tokens(llm.generate(ids([target]), sp, use_tqdm=False))[0]
        for pos in (0, 13, 31):
            batch = others[:pos] + [target] + others[pos:]
            other_sp = SamplingParams(temperature=1.0, seed=7, max_tokens=20, ignore_eos=True)
            params = [other_sp] * pos + [sp] + [other_sp] * (31 - pos)
            outs = llm.generate(ids(batch), params, use_tqdm=False)
            assert outs[pos].outputs[0].token_ids == alone, (sp.temperature, pos)


def test_preemption_at_quarter_kv_budget_matches_unconstrained(llm):
    ps = prompts(32, seed=2, lo=8, hi=24)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = tokens(llm.generate(ids(ps), sp, use_tqdm=False))
    demand = sum(-(-(len(p) + 40) // 32) for p in ps)
    small = make_llm(num_pages=demand // 4)
    outs = small.generate(ids(ps), sp, use_tqdm=False)
    assert tokens(outs) == want
    stats = small.stats()
    assert stats["num_preemptions"] > 0
    assert sum(o.metrics.num_preemptions for o in outs) == stats["num_preemptions"]
    assert small.engine.scheduler.allocator.num_free_pages == demand // 4


def test_bad_prompts_and_params_fail_alone(llm):
    good = [5, 6, 7]
    batch = [
        ids([good])[0],
        {"prompt_token_ids": []},
        "text but no tokenizer",
        {"prompt_token_ids": [3] * 64},
        ids([good])[0],
        {"bogus": 1},
        ids([good])[0],
    ]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    params = [sp] * 6 + [{"temperature": -1.0}]
    outs = llm.generate(batch, params, use_tqdm=False)
    assert [o.error is None for o in outs] == [True, False, False, False, True, False, False]
    assert outs[0].outputs[0].token_ids == outs[4].outputs[0].token_ids
    assert len(outs[0].outputs[0].token_ids) == 4
    assert "empty" in outs[1].error and "tokenizer" in outs[2].error
    assert "max_model_len" in outs[3].error and "bogus" in outs[5].error
    assert "temperature" in outs[6].error
    assert all(o.outputs[0].finish_reason == "error" for o in outs if o.error)


def test_stream_and_iter_generate(llm):
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    final = llm.generate(ids([[4, 5, 6]]), sp, use_tqdm=False)[0]
    # A stop token ends the request where the scheduler could not foresee it, so async scheduling
    # has queued one more step; generate drains it: no step or host copy outlives the call.
    stop_at = SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True, stop_token_ids=[final.outputs[0].token_ids[2]]
    )
    assert len(llm.generate(ids([[4, 5, 6]]), stop_at, use_tqdm=False)[0].outputs[0].token_ids) == 3
    assert llm.engine._inflight is None
    snaps = list(llm.stream({"prompt_token_ids": [4, 5, 6]}, sp))
    assert [len(s.outputs[0].token_ids) for s in snaps] == [1, 2, 3, 4, 5, 6]
    assert snaps[-1].finished and snaps[-1].outputs[0].token_ids == final.outputs[0].token_ids
    deltas = list(llm.stream({"prompt_token_ids": [4, 5, 6]}, sp, delta=True))
    assert sum((d.outputs[0].token_ids for d in deltas), []) == final.outputs[0].token_ids

    lens = [9, 2, 5]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
    got = list(llm.iter_generate(ids([[4, 5]] * 3), params))
    assert [i for i, _ in got] == [1, 2, 0]  # completion order
    assert [len(o.outputs[0].token_ids) for _, o in got] == [2, 5, 9]
    # closing early aborts the rest and leaves the engine clean
    it = llm.iter_generate(ids([[4, 5]] * 3), params)
    next(it)
    it.close()
    assert not llm.engine.has_unfinished()
    # stop: the outputs finished in the step already run are all yielded, then no more steps
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 3, 9)]
    flag = []
    got = []
    for i, o in llm.iter_generate(ids([[4, 5]] * 3), params, stop=lambda: bool(flag)):
        got.append((i, len(o.outputs[0].token_ids)))
        flag.append(1)  # the "signal" arrives after the first output
    assert sorted(got) == [(0, 3), (1, 3)]  # both finished in the same step
    assert not llm.engine.has_unfinished()


def test_n_samples_and_progress_bar(llm, capsys):
    sp = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    outs = llm.generate(ids([[4, 5, 6], [7, 8]]), sp, use_tqdm=True)
    assert [len(o.outputs) for o in outs] == [3, 3]
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1
    again = llm.generate(ids([[4, 5, 6]]), sp, use_tqdm=False)[0]  # seeded: reproducible
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in outs[0].outputs]
    assert "2/2" in capsys.readouterr().err  # counted in prompts, not sequences


def test_static_batching_same_tokens_more_steps(llm):
    ps = prompts(40, seed=3, lo=3, hi=10)
    params = [
        SamplingParams(temperature=0, max_tokens=2 + (7 * i) % 30, ignore_eos=True)
        for i in range(40)
    ]
    steps0 = llm.stats()["num_steps"]
    want = tokens(llm.generate(ids(ps), params, use_tqdm=False))
    continuous_steps = llm.stats()["num_steps"] - steps0
    static = make_llm(batching="static")
    assert tokens(static.generate(ids(ps), params, use_tqdm=False)) == want
    assert static.stats()["num_steps"] > continuous_steps


@pytest.mark.parametrize(
    "kw, word",
    [
        (dict(num_slots=0), "num_slots"),
        (dict(max_model_len=10_000), "max_model_len"),
        (dict(page_size=12), "page_size"),
        (dict(kv_cache_memory=10), "kv_cache_memory"),
        (dict(batching="dynamic"), "batching"),
        (dict(dtype="float16"), "dtype"),
        (dict(attention_impl="flash"), "attention_impl"),
        (dict(enable_prefix_caching="yes"), "enable_prefix_caching"),
        (dict(slot_buckets=(8, 16)), "slot_buckets"),  # must end at num_slots (32)
        (dict(slot_buckets=(16, 8, 32)), "slot_buckets"),
        (dict(slot_buckets="none"), "slot_buckets"),
        (dict(seed=1.5), "seed"),
        (dict(max_model_len=1), "max_model_len"),
        (dict(load_format="gguf"), "load_format"),
    ],
)
def test_bad_arguments_raise(kw, word):
    with pytest.raises(ValueError, match=word):
        make_llm(**kw)


def test_arguments_are_engine_config_fields(monkeypatch):
    for name in ("fuse_prefill", "max_seq_len"):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{name}'"):
            make_llm(**{name: 1})

    def no_load(*args, **kwargs):
        raise AssertionError("the model loaded before the arguments were checked")

    monkeypatch.setattr("jaxserve.loading.load_model", no_load)
    with pytest.raises(ValueError, match="prefill_chunk_size"):
        make_llm(prefill_chunk_size=48)


def test_model_dependent_defaults_are_filled():
    """LLM's defaults: max_model_len min(512, 2048) for tiny, 64-token chunks, 8 per step; the
    chunk capped at the next power of two of a short max_model_len."""
    c = LLM("tiny", load_format="dummy", dtype="float32", num_slots=2).engine_config
    assert (c.max_model_len, c.prefill_chunk_size, c.max_num_batched_tokens) == (512, 64, 512)
    c = LLM("tiny", load_format="dummy", dtype="float32", num_slots=2, max_model_len=20)
    c = c.engine_config
    assert (c.max_model_len, c.prefill_chunk_size, c.max_num_batched_tokens) == (20, 32, 256)


def test_ragged_and_reference_attention_give_the_same_tokens(llm):
    """The CPU default ('ragged' decode attention over the live pages) decodes the same greedy
    tokens as the gather reference, over lengths spanning one and two pages."""
    assert llm.engine.runner.resolved.ragged
    ps = ids(prompts(12, seed=4, lo=3, hi=50))
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = tokens(make_llm(attention_impl="reference").generate(ps, sp, use_tqdm=False))
    assert tokens(llm.generate(ps, sp, use_tqdm=False)) == want


def test_pallas_interpret_attention_gives_reference_tokens(llm):
    """EngineConfig.attention_impl reaches the kernels: Pallas (interpret mode on CPU) decodes the
    same greedy tokens as the jnp reference."""
    ps = ids([[5, 6, 7, 8, 9, 10, 11], list(range(3, 30))])
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = tokens(llm.generate(ps, sp, use_tqdm=False))
    pallas = make_llm(attention_impl="pallas_interpret", num_slots=4)
    assert tokens(pallas.generate(ps, sp, use_tqdm=False)) == want


def test_prefix_caching_gives_the_same_tokens_with_less_prefill(llm):
    rng = np.random.default_rng(7)
    system = rng.integers(3, 128, 40).tolist()  # one full 32-token page is shareable
    ps = [system + rng.integers(3, 128, int(k)).tolist() for k in rng.integers(1, 10, 12)]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    sampled = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)
    before = llm.stats()["num_prefill_tokens"]
    want = llm.generate(ids(ps + [system]), [greedy] * len(ps) + [sampled], use_tqdm=False)
    computed = llm.stats()["num_prefill_tokens"] - before
    cached = make_llm(enable_prefix_caching=True)
    outs = cached.generate(ids(ps + [system]), [greedy] * len(ps) + [sampled], use_tqdm=False)
    assert tokens(outs[:-1]) == tokens(want[:-1])
    assert [c.token_ids for c in outs[-1].outputs] == [c.token_ids for c in want[-1].outputs]
    assert cached.stats()["num_cached_prefill_tokens"] == sum(o.num_cached_tokens for o in outs)
    hits = sum(o.num_cached_tokens for o in outs)
    assert hits >= 32 * 12  # all but the first admissions hit
    assert cached.stats()["num_prefill_tokens"] == computed - hits


def test_prefix_caching_reuses_a_previous_answers_pages(llm):
    """A next turn (prompt + answer + more) hits the page decode steps filled: K/V computed one
    token at a time serves a prefill, and the tokens equal an uncached run's."""
    first = list(range(40, 60))  # 20 tokens: no full 32-token page of prompt alone
    sp = [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in (20, 12)]
    cached = make_llm(enable_prefix_caching=True)
    answer = cached.generate(ids([first]), sp[0], use_tqdm=False)[0].outputs[0].token_ids
    second = first + answer + [7, 8, 9, 10, 11]  # 45 tokens: page 0 is 20 prompt + 12 answer
    out = cached.generate(ids([second]), sp[1], use_tqdm=False)[0]
    assert out.num_cached_tokens == 32
    want = tokens(llm.generate(ids([first, second]), sp, use_tqdm=False))
    assert [answer, out.outputs[0].token_ids] == want
    assert cached.reset_prefix_cache()
    again = cached.generate(ids([second]), sp[1], use_tqdm=False)[0]
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == want[1]


@pytest.mark.parametrize("num_pages", [32, 24])
def test_shared_pages_past_the_pool_size_give_the_same_tokens(num_pages):
    """Issue 24: with prefix caching a shared page is listed once per request that reads it, so a
    decode step can list more pages than the pool holds. The CPU's ragged attention once capped its
    page list at num_pages and dropped the rest: n=8 greedy gave 4 different answers. Now every
    child equals the reference attention without caching, at a pool where nothing is preempted
    (32 pages) and where the shared pages are most of the pool (24)."""
    kw = dict(max_model_len=64, page_size=4, num_slots=8, num_pages=num_pages)
    prompt = ids([list(range(3, 43))])  # 40 tokens: 10 shared pages
    sp = SamplingParams(n=8, temperature=0, max_tokens=8, ignore_eos=True)
    cached = make_llm(enable_prefix_caching=True, **kw).generate(prompt, sp, use_tqdm=False)[0]
    assert cached.num_cached_tokens > 0  # the children did share the prompt's pages
    plain = make_llm(attention_impl="reference", **kw).generate(prompt, sp, use_tqdm=False)[0]
    want = plain.outputs[0].token_ids
    assert all(c.token_ids == want for c in plain.outputs)
    assert [c.token_ids for c in cached.outputs] == [want] * 8


def test_a_poison_prompt_or_parameter_fails_alone(llm):
    """Issue 24: values too large for their field and an untokenizable prompt become that
    prompt's error; the prompts beside them finish as usual."""
    ok = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    ps = ids([[5, 6, 7]] * 4)
    params = [{"temperature": 10**400}, {"top_k": 2**40}, {"n": 10**6}, ok]
    outs = llm.generate(ps, params, use_tqdm=False)
    assert [o.error is not None for o in outs] == [True, True, True, False]
    assert "temperature" in outs[0].error and "top_k" in outs[1].error and "n" in outs[2].error
    assert len(outs[3].outputs[0].token_ids) == 3


class _SurrogateRejectingTokenizer:
    """Raises as Hugging Face's fast tokenizer does on a lone UTF-16 surrogate."""

    eos_token_id = 2

    def __call__(self, text, **kw):
        text.encode("utf-8")  # UnicodeEncodeError on a lone surrogate
        return {"input_ids": [5 + len(text) % 7]}


def test_an_untokenizable_prompt_fails_alone():
    llm = make_llm(num_slots=4)
    llm.tokenizer = _SurrogateRejectingTokenizer()
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    outs = llm.generate(["fine", "bad \ud800 surrogate", "also fine"], sp, use_tqdm=False)
    assert outs[1].error is not None and "tokenize" in outs[1].error
    assert outs[0].error is None and outs[2].error is None


class _InterruptingTokenizer:
    """Tokenizes two prompts, then the user presses Ctrl-C (KeyboardInterrupt mid-submission)."""

    eos_token_id = 2

    def __init__(self):
        self.calls = 0

    def __call__(self, text, **kw):
        self.calls += 1
        if self.calls == 3:
            raise KeyboardInterrupt
        return {"input_ids": [5, 6, 7]}


def test_an_interrupted_generate_leaves_no_request_behind():
    """Issue 24: generate() interrupted while submitting (Ctrl-C while tokenizing a long list)
    leaves no orphaned request inside the engine: the requests already queued are aborted."""
    llm = make_llm(num_slots=4)
    llm.tokenizer = _InterruptingTokenizer()
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["a", "b", "c", "d"], sp, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    llm.tokenizer = _SurrogateRejectingTokenizer()
    assert llm.generate(["after"], sp, use_tqdm=False)[0].error is None  # the engine still works


class _CountingDict(dict):
    """A dict that counts the lookups and iterated keys the host loop spends on it."""

    ops = 0

    def get(self, key, default=None):
        _CountingDict.ops += 1
        return super().get(key, default)

    def __iter__(self):
        for k in super().__iter__():
            _CountingDict.ops += 1
            yield k


def test_iter_generate_costs_constant_bookkeeping_per_output():
    """Issue 24: iter_generate once checked every outstanding request after every step (O(requests
    x steps)); its outbox bookkeeping is now proportional to the outputs. Counted, not timed
    (experiments/host_loop_scaling.py has the timing)."""
    llm = make_llm(num_slots=4)
    llm._outbox = _CountingDict()
    _CountingDict.ops = 0
    n = 64
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    outs = llm.generate(ids([[5 + i % 50] for i in range(n)]), sp, use_tqdm=False)
    assert all(o.error is None for o in outs)
    steps = llm.stats()["num_steps"]
    assert steps >= n // 4  # 4 slots: many steps with most requests still waiting
    assert _CountingDict.ops <= 4 * n  # the old scan: about n * steps / 2 (> 1,000 here)
