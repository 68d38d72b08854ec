"""The host loop against a fake model whose tokens are computable by hand (jaxserve/testing/fake_runner.py).

Fill, retire, refill, chunked prefill, preempt and resume, every stop condition, n > 1, static
batching, multi-step decode and per-prompt errors: each shows up as an exact token mismatch.
"""

from __future__ import annotations

import dataclasses

import pytest

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.core.detokenizer import held_back
from jaxserve.core.engine import LLMEngine
from jaxserve.core.request import derive_seed
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.testing.fake_runner import FakeRunner, default_rule, fake_logprob, reference

EOS = 2
VOCAB = 64


class LetterTokenizer:
    """Token t decodes to one letter; the EOS token is special (skipped)."""

    eos_token_id = EOS

    def decode(self, ids, skip_special_tokens=True):
        return "".join("" if (t == EOS and skip_special_tokens) else chr(97 + t % 26) for t in ids)


def make_engine(
    num_slots=3,
    num_pages=64,
    page_size=4,
    decode_steps=1,
    chunk=8,
    rows=2,
    max_model_len=64,
    batching="continuous",
    rule=default_rule,
    tokenizer=None,
    async_scheduling=True,
    enable_prefix_caching=False,
    slot_buckets=None,
):
    mc = dataclasses.replace(ModelConfig.preset("tiny"), vocab_size=VOCAB, eos_token_ids=(EOS,))
    ec = EngineConfig(
        num_slots=num_slots,
        max_model_len=max_model_len,
        page_size=page_size,
        num_pages=num_pages,
        dtype="float32",
        max_num_batched_tokens=rows * chunk,
        prefill_chunk_size=chunk,
        decode_steps=decode_steps,
        batching=batching,
        async_scheduling=async_scheduling,
        enable_prefix_caching=enable_prefix_caching,
        slot_buckets=slot_buckets or "auto",
    )
    runner = FakeRunner(
        num_slots, num_pages, page_size, decode_steps, rule, rows, chunk, slot_buckets
    )
    return LLMEngine(runner, mc, ec, num_pages, tokenizer=tokenizer), runner


def run_all(engine, max_steps=10_000):
    outs = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return outs
        for out in engine.step():
            outs[out.request_id] = out
    raise AssertionError("engine did not finish")


def prompts(n, lo=3, hi=20):
    return [
        [(7 * i + j) % (VOCAB - 3) + 3 for j in range(lo + (5 * i) % (hi - lo))] for i in range(n)
    ]


def greedy(**kw):
    return SamplingParams(temperature=0.0, seed=0, **kw)


@pytest.mark.parametrize("async_sched", [True, False])
def test_fill_retire_refill_matches_reference(async_sched):
    engine, runner = make_engine(num_slots=3, async_scheduling=async_sched)
    ps = prompts(10)
    lens = [1, 5, 12, 3, 30, 7, 2, 9, 16, 4]
    for i, (p, n) in enumerate(zip(ps, lens)):
        # logprobs=0: vLLM sets cumulative_logprob only when log-probs are requested
        engine.add_request(str(i), None, p, greedy(max_tokens=n, ignore_eos=True, logprobs=0))
    outs = run_all(engine)
    for i, (p, n) in enumerate(zip(ps, lens)):
        out = outs[str(i)].outputs[0]
        assert out.token_ids == reference(p, n), i
        assert out.finish_reason == "length"
        assert out.cumulative_logprob == pytest.approx(sum(fake_logprob(t) for t in out.token_ids))
    assert max(len(p["decode"]) for p in runner.log) == 3  # slots were full at some point
    assert all(len(p["prefill"]) <= 2 for p in runner.log)
    # a slot freed by a retiring request is reused by the next plan
    assert any(set(p["released"]) & set(p["inserted"]) for p in runner.log)
    st = engine.stats()
    assert st["num_finished_requests"] == 10 and st["num_preemptions"] == 0
    assert st["num_generation_tokens"] == sum(lens)
    assert st["num_prefill_tokens"] == sum(len(p) for p in ps)
    assert st["num_d2h_transfers"] == st["num_steps"]  # one device->host transfer per step
    assert 0 < st["mean_slot_occupancy"] <= 1 and 0 < st["kv_page_utilization"] <= 1


def test_chunked_prefill_interleaves_with_decode():
    engine, runner = make_engine(num_slots=2, chunk=4, rows=1, max_model_len=128)
    short, long = [5, 6, 7], list(range(3, 60))
    engine.add_request("a", None, short, greedy(max_tokens=30, ignore_eos=True))
    engine.add_request("b", None, long, greedy(max_tokens=5, ignore_eos=True))
    outs = run_all(engine)
    assert outs["a"].outputs[0].token_ids == reference(short, 30)
    assert outs["b"].outputs[0].token_ids == reference(long, 5)
    assert any(p["decode"] and p["prefill"] for p in runner.log)  # decodes ran during b's prefill
    assert all(length <= 4 for p in runner.log for _, _, length in p["prefill"])


@pytest.mark.parametrize("async_sched", [True, False])
def test_preemption_resumes_with_identical_tokens(async_sched):
    # 8 requests that each need ~10 pages; the pool holds 16: preemption is unavoidable.
    engine, runner = make_engine(
        num_slots=4, num_pages=16, page_size=4, max_model_len=64, async_scheduling=async_sched
    )
    ps = prompts(8, 4, 12)
    for i, p in enumerate(ps):
        engine.add_request(str(i), None, p, greedy(max_tokens=30, ignore_eos=True))
    outs = run_all(engine)
    for i, p in enumerate(ps):
        assert outs[str(i)].outputs[0].token_ids == reference(p, 30), i
    assert engine.stats()["num_preemptions"] > 0
    assert (
        sum(o.metrics.num_preemptions for o in outs.values()) == engine.stats()["num_preemptions"]
    )
    assert engine.scheduler.allocator.num_free_pages == 16  # every page came back


def test_a_plan_that_only_releases_a_slot_still_reaches_the_runner():
    """A plan can hold no step at all yet change the slots: here b (newest) preempts itself for a
    page while a is at its length limit with its last step in flight, so the plan only releases
    b's slot. The runner must still apply it, or b's old slot stays active on the device and
    decodes into freed pages (the fake runner asserts every active slot is planned)."""
    engine, runner = make_engine(num_slots=2, num_pages=3, page_size=4, chunk=8, rows=2)
    engine.add_request("a", None, [3, 3], greedy(max_tokens=4, ignore_eos=True))
    engine.add_request("b", None, [4], greedy(max_tokens=5, ignore_eos=True))
    outs = run_all(engine)
    assert outs["a"].outputs[0].token_ids == reference([3, 3], 4)
    assert outs["b"].outputs[0].token_ids == reference([4], 5)
    # the preemption happened in a plan with no step, which was dispatched all the same
    assert any(p["released"] and not p["decode"] and not p["prefill"] for p in runner.log)
    assert engine.stats()["num_preemptions"] > 0


@pytest.mark.parametrize("async_sched", [True, False])
def test_preemption_with_multistep_decode(async_sched):
    engine, _ = make_engine(
        num_slots=4, num_pages=14, page_size=4, decode_steps=3, async_scheduling=async_sched
    )
    ps = prompts(6, 4, 10)
    for i, p in enumerate(ps):
        engine.add_request(str(i), None, p, greedy(max_tokens=25 + i, ignore_eos=True))
    outs = run_all(engine)
    for i, p in enumerate(ps):
        assert outs[str(i)].outputs[0].token_ids == reference(p, 25 + i), i
    assert engine.stats()["num_preemptions"] > 0


@pytest.mark.parametrize("async_sched", [True, False])
@pytest.mark.parametrize("decode_steps,num_pages", [(1, 64), (2, 64), (1, 20)])
def test_slot_buckets_pack_survivors_into_low_slots(async_sched, decode_steps, num_pages):
    # 8 slots, row buckets (2, 4, 8): as requests retire the survivors are moved down so decode
    # steps shrink to 4 and then 2 rows; at 20 pages requests are also preempted and resumed.
    engine, runner = make_engine(
        num_slots=8,
        num_pages=num_pages,
        page_size=4,
        decode_steps=decode_steps,
        async_scheduling=async_sched,
        slot_buckets=(2, 4, 8),
    )
    ps = prompts(14, 3, 12)
    lens = [3, 40, 5, 2, 30, 8, 1, 25, 6, 12, 4, 35, 9, 2]
    for i, (p, n) in enumerate(zip(ps, lens)):
        engine.add_request(str(i), None, p, greedy(max_tokens=n, ignore_eos=True))
    outs = run_all(engine)
    for i, (p, n) in enumerate(zip(ps, lens)):
        assert outs[str(i)].outputs[0].token_ids == reference(p, n), i
    moves = [m for plan in runner.plans for m in plan.moves]
    assert moves and all(dst < src for src, dst in moves)
    assert {2, 4, 8} <= set(runner.decode_rows)
    if num_pages == 20:
        assert engine.stats()["num_preemptions"] > 0
    assert engine.scheduler.allocator.num_free_pages == num_pages
    assert sorted(engine.scheduler.free_slots) == list(range(8))


def test_compact_moves_only_when_the_bucket_shrinks():
    engine, _ = make_engine(num_slots=8, slot_buckets=(2, 4, 8), async_scheduling=False)
    sched = engine.scheduler
    for i, p in enumerate(prompts(5, 3, 6)):
        engine.add_request(str(i), None, p, greedy(max_tokens=50, ignore_eos=True))
    while len(sched.running) < 5:
        engine.step()
    assert sorted(r.slot for r in sched.running) == [0, 1, 2, 3, 4]
    engine.abort("0")
    engine.abort("1")
    plan = sched.schedule()  # 3 left (slots 2, 3, 4): bucket 4 holds them, 4 moves to 0
    assert plan.moves == [(4, 0)]
    assert sorted(r.slot for r in sched.running) == [0, 2, 3]
    plan2 = sched.schedule()
    assert plan2.moves == []  # already packed for bucket 4


@pytest.mark.parametrize("async_sched", [True, False])
def test_eos_and_ignore_eos(async_sched):
    # rule: count up from the last token; EOS (2) appears after ...62, 63, 0, 1, 2.
    rule = lambda seq, seed: (seq[-1] + 1) % VOCAB
    engine, _ = make_engine(rule=rule, async_scheduling=async_sched)
    engine.add_request("eos", None, [60], greedy(max_tokens=20))
    engine.add_request("ignore", None, [60], greedy(max_tokens=20, ignore_eos=True))
    engine.add_request("min", None, [0], greedy(max_tokens=20, min_tokens=3))
    outs = run_all(engine)
    assert outs["eos"].outputs[0].token_ids == [61, 62, 63, 0, 1, 2]
    assert (outs["eos"].outputs[0].finish_reason, outs["eos"].outputs[0].stop_reason) == (
        "stop",
        None,
    )
    assert len(outs["ignore"].outputs[0].token_ids) == 20
    assert outs["ignore"].outputs[0].finish_reason == "length"
    # EOS as the 2nd token does not stop before min_tokens=3 (the real sampler also masks it)
    assert outs["min"].outputs[0].token_ids[:3] == [1, 2, 3]


def test_stop_token_ids_max_tokens_and_max_model_len():
    rule = lambda seq, seed: (seq[-1] + 1) % VOCAB
    engine, _ = make_engine(rule=rule, max_model_len=16)
    engine.add_request("stopid", None, [10], greedy(max_tokens=20, stop_token_ids=[14]))
    engine.add_request("maxtok", None, [10], greedy(max_tokens=3))
    engine.add_request("maxlen", None, [20] * 10, greedy(max_tokens=50))
    outs = run_all(engine)
    o = outs["stopid"].outputs[0]
    assert (o.token_ids, o.finish_reason, o.stop_reason) == ([11, 12, 13, 14], "stop", 14)
    assert outs["maxtok"].outputs[0].token_ids == [11, 12, 13]
    assert outs["maxtok"].outputs[0].finish_reason == "length"
    o = outs["maxlen"].outputs[0]
    assert len(o.token_ids) == 6 and o.finish_reason == "length"  # 10 + 6 = max_model_len


@pytest.mark.parametrize("async_sched", [True, False])
def test_stop_strings_truncate_text(async_sched):
    rule = lambda seq, seed: (seq[-1] + 1) % 26 + 26  # letters ... 'x', 'y', 'z', 'a', ...
    tok = LetterTokenizer()
    engine, _ = make_engine(rule=rule, tokenizer=tok, async_scheduling=async_sched)
    engine.add_request("cut", None, [26 + 3], greedy(max_tokens=20, stop=["gh", "zz"]))
    engine.add_request(
        "keep", None, [26 + 3], greedy(max_tokens=20, stop="gh", include_stop_str_in_output=True)
    )
    outs = run_all(engine)
    cut, keep = outs["cut"].outputs[0], outs["keep"].outputs[0]
    assert (cut.text, cut.finish_reason, cut.stop_reason) == ("ef", "stop", "gh")
    assert cut.token_ids == [30, 31, 32, 33]  # the tokens up to the one completing the stop string
    assert keep.text == "efgh"


def test_a_stop_tokens_text_is_left_out_unless_asked_for():
    """As vLLM: when a stop token ends the request (a stop_token_ids entry, or EOS decoded with
    skip_special_tokens=False), its text is not in the output unless include_stop_str_in_output."""
    rule = lambda seq, seed: (seq[-1] + 1) % 26 + 26  # letters: 'e', 'f', 'g', ...
    engine, _ = make_engine(rule=rule, tokenizer=LetterTokenizer())
    stop = dict(max_tokens=20, stop_token_ids=[33])  # token 33 decodes to 'h'
    engine.add_request("cut", None, [26 + 3], greedy(**stop))
    engine.add_request("keep", None, [26 + 3], greedy(**stop, include_stop_str_in_output=True))
    outs = run_all(engine)
    cut, keep = outs["cut"].outputs[0], outs["keep"].outputs[0]
    assert cut.token_ids == keep.token_ids == [30, 31, 32, 33]
    assert (cut.text, cut.stop_reason) == ("efg", 33)
    assert keep.text == "efgh"
    eos_rule = lambda seq, seed: EOS if len(seq) >= 3 else 30 + len(seq)
    engine, _ = make_engine(rule=eos_rule, tokenizer=LetterTokenizer())
    shown = dict(max_tokens=9, skip_special_tokens=False)
    engine.add_request("eos", None, [30], greedy(**shown))
    engine.add_request("eos_kept", None, [30], greedy(**shown, include_stop_str_in_output=True))
    outs = run_all(engine)
    assert outs["eos"].outputs[0].token_ids == [31, 32, EOS]
    assert outs["eos"].outputs[0].text == "fg"  # EOS decodes to 'c' when shown: left out
    assert outs["eos_kept"].outputs[0].text == "fgc"


def test_n_children_have_distinct_seeds_and_tokens():
    rule = lambda seq, seed: (sum(seq) + seed) % VOCAB
    engine, _ = make_engine(rule=rule)
    engine.add_request(
        "r", None, [5, 6], SamplingParams(n=3, seed=11, max_tokens=6, ignore_eos=True)
    )
    out = run_all(engine)["r"]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for c in out.outputs:
        assert c.token_ids == reference([5, 6], 6, seed=derive_seed(11, c.index), rule=rule)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    assert derive_seed(11, 0) == 11


def test_static_batching_refills_only_when_batch_done():
    engine, runner = make_engine(num_slots=3, batching="static")
    lens = [2, 20, 3, 4, 5, 6]
    for i, n in enumerate(lens):
        engine.add_request(str(i), None, [4 + i, 5], greedy(max_tokens=n, ignore_eos=True))
    outs = run_all(engine)
    for i, n in enumerate(lens):
        assert outs[str(i)].outputs[0].token_ids == reference([4 + i, 5], n)
    admits = [i for i, p in enumerate(runner.log) if p["inserted"]]
    assert len(admits) == 2 and len(runner.log[admits[0]]["inserted"]) == 3
    # the second batch starts only after request 1 (20 tokens) finished
    assert admits[1] >= 20  # step 0 prefills its first token, steps 1..19 decode the rest


def test_bad_prompts_fail_alone():
    engine, _ = make_engine(max_model_len=32, num_pages=6, page_size=4)
    engine.add_request("ok", None, [3, 4], greedy(max_tokens=4, ignore_eos=True))
    engine.add_request("empty", None, [], greedy())
    engine.add_request("long", None, [3] * 32, greedy())
    engine.add_request("vocab", None, [3, VOCAB], greedy())
    engine.add_request("nofit", None, [3] * 20, greedy(max_tokens=11))  # 30 tokens > 6 pages of 4
    engine.add_request("stopstr", None, [3], greedy(stop="x"))  # no tokenizer
    engine.add_request("params", None, [3], {"temperature": 1.0})
    outs = run_all(engine)
    assert outs["ok"].error is None and outs["ok"].outputs[0].token_ids == reference([3, 4], 4)
    expect = {
        "empty": "empty",
        "long": "max_model_len",
        "vocab": "vocab_size",
        "nofit": "never fit",
        "stopstr": "tokenizer",
        "params": "SamplingParams",
    }
    for rid, words in expect.items():
        assert words in outs[rid].error, (rid, outs[rid].error)
        assert outs[rid].outputs[0].finish_reason == "error" and outs[rid].finished


def test_abort_frees_slot_and_pages():
    engine, _ = make_engine(num_slots=1, num_pages=16)
    engine.add_request("a", None, [3, 4], greedy(max_tokens=40, ignore_eos=True))
    engine.add_request("b", None, [5, 6], greedy(max_tokens=3, ignore_eos=True))
    for _ in range(3):
        engine.step()
    engine.abort("a")
    assert engine.scheduler.allocator.num_free_pages == 16
    outs = run_all(engine)
    assert list(outs) == ["b"] and outs["b"].outputs[0].token_ids == reference([5, 6], 3)


def test_streamed_request_reports_every_step():
    engine, _ = make_engine()
    engine.add_request("s", None, [3, 4], greedy(max_tokens=5, ignore_eos=True), stream=True)
    snaps = []
    while engine.has_unfinished():
        snaps += engine.step()
    assert [len(s.outputs[0].token_ids) for s in snaps] == [1, 2, 3, 4, 5]
    assert [s.finished for s in snaps] == [False] * 4 + [True]
    m = snaps[-1].metrics
    assert m.ttft >= 0 and m.tpot >= 0 and m.finished_time >= m.first_token_time


def test_streamed_snapshots_hold_back_a_possible_stop_string():
    """While streaming, a tail that could start a stop string is not shown yet: shown text is never
    retracted, and a false start is released once it cannot match any more."""
    rule = lambda seq, seed: (seq[-1] + 1) % 26 + 26  # letters e, f, g, h, i, ...
    engine, _ = make_engine(rule=rule, tokenizer=LetterTokenizer())
    engine.add_request("a", None, [26 + 3], greedy(max_tokens=20, stop=["gh"]), stream=True)
    engine.add_request("b", None, [26 + 3], greedy(max_tokens=5, stop=["gx", "fgz"]), stream=True)
    texts = {"a": [], "b": []}
    while engine.has_unfinished():
        for out in engine.step():
            texts[out.request_id].append(out.outputs[0].text)
    assert texts["a"] == ["e", "ef", "ef", "ef"]  # 'g' held back, then the stop cut the text
    assert texts["b"] == ["e", "e", "e", "efgh", "efghi"]  # 'f', 'fg' held; released at 'h'
    for t in texts.values():
        assert all(t[i + 1].startswith(t[i]) for i in range(len(t) - 1))
    assert held_back("abc", ("cd", "bcx")) == 2 and held_back("abc", ("zz",)) == 0


@pytest.mark.parametrize("async_sched", [True, False])
@pytest.mark.parametrize("num_pages", [64, 14])  # 14: preemption under pressure
def test_prefix_caching_reuses_pages_with_identical_tokens(async_sched, num_pages):
    """Shared prefixes and n > 1 siblings read cached pages through their page tables: a wrong
    page (freed, evicted and rewritten, or another prefix's) would change the fake model's tokens."""
    rule = lambda seq, seed: (sum((i + 1) * t for i, t in enumerate(seq)) + seed) % VOCAB
    system = [(5 * j) % 50 + 3 for j in range(13)]  # 3 full pages of 4 and one token
    ps = [system + [10 + i, 20 + i, 30 + i] for i in range(5)] + [system[:9], system]
    results = {}
    for caching in (False, True):
        engine, runner = make_engine(
            num_slots=3,
            num_pages=num_pages,
            rule=rule,
            async_scheduling=async_sched,
            enable_prefix_caching=caching,
        )
        for i, p in enumerate(ps):
            engine.add_request(str(i), None, p, greedy(max_tokens=9, ignore_eos=True))
        engine.add_request(
            "n", None, system, SamplingParams(n=3, seed=11, max_tokens=7, ignore_eos=True)
        )
        outs = run_all(engine)
        for i, p in enumerate(ps):
            assert outs[str(i)].outputs[0].token_ids == reference(p, 9, rule=rule), (caching, i)
        for c in outs["n"].outputs:
            want = reference(system, 7, seed=derive_seed(11, c.index), rule=rule)
            assert c.token_ids == want, (caching, c.index)
        assert engine.scheduler.allocator.num_free_pages == num_pages  # every page came back
        results[caching] = engine.stats()
        if caching and num_pages == 64:  # 0 and 1 were admitted together; the rest hit
            assert outs["n"].num_cached_tokens == 3 * 12
            assert [outs[str(i)].num_cached_tokens for i in range(7)] == [0, 0, 12, 12, 12, 8, 12]
    cached = results[True]["num_cached_prefill_tokens"]
    assert results[False]["num_cached_prefill_tokens"] == 0
    assert cached >= 12 * 6  # every later request took >= 3 system pages (more with resumes)
    total = results[False]["num_prefill_tokens"]
    if num_pages == 64:  # no preemption: exactly the cached tokens were not recomputed
        assert results[True]["num_prefill_tokens"] == total - cached
        assert results[True]["num_preemptions"] == 0
    else:
        assert results[True]["num_preemptions"] > 0


@pytest.mark.parametrize("async_sched", [True, False])
def test_prefix_caching_reuses_prompt_pages_not_generated_ones(async_sched):
    """A chat's next turn (the last prompt, its answer, a new message) reads the last prompt's
    pages from the cache and recomputes the answer's (K/V written by decode steps are not cached:
    they differ in bf16 from a prefill's, issue 24); a request preempted with caching on resumes
    from its own cached prompt pages."""
    rule = lambda seq, seed: (sum((i + 1) * t for i, t in enumerate(seq)) + seed) % VOCAB
    first = list(range(3, 13))  # 10 tokens: 2 full pages of 4
    engine, _ = make_engine(num_slots=2, async_scheduling=async_sched, enable_prefix_caching=True)
    engine.add_request("1", None, first, greedy(max_tokens=12, ignore_eos=True))
    answer = run_all(engine)["1"].outputs[0].token_ids
    assert answer == reference(first, 12, rule=default_rule)
    second = first + answer + [7, 8, 9]  # 25 tokens; K/V of the first 21 was computed
    engine.add_request("2", None, second, greedy(max_tokens=6, ignore_eos=True))
    out = run_all(engine)["2"]
    assert out.outputs[0].token_ids == reference(second, 6, rule=default_rule)
    assert out.num_cached_tokens == 8  # the first prompt's 2 pages, none of the answer's

    # 3 slots of 8-token prompts growing to 22 tokens (6 pages each) in 16 pages: the newest is
    # preempted, and resumes from its 2 prompt pages (its generated ones were not cached)
    ps = [[(5 * j + i) % 50 + 3 for j in range(8)] for i in range(3)]
    engine, _ = make_engine(
        num_slots=3, num_pages=16, rule=rule, async_scheduling=async_sched,
        enable_prefix_caching=True,
    )  # fmt: skip
    for i, p in enumerate(ps):
        engine.add_request(str(i), None, p, greedy(max_tokens=14, ignore_eos=True))
    outs = run_all(engine)
    for i, p in enumerate(ps):
        assert outs[str(i)].outputs[0].token_ids == reference(p, 14, rule=rule), i
    stats = engine.stats()
    assert stats["num_preemptions"] == 1
    assert outs["2"].num_cached_tokens == 8  # every prompt differs: the resume hit its own
    assert engine.scheduler.allocator.num_free_pages == 16


def test_n_siblings_share_child_zeros_prompt_pages():
    rule = lambda seq, seed: (sum((i + 1) * t for i, t in enumerate(seq)) + seed) % VOCAB
    prompt = list(range(3, 21))  # 18 tokens: 4 full pages of 4, the last page is computed
    engine, runner = make_engine(num_slots=4, rule=rule, enable_prefix_caching=True)
    engine.add_request(
        "n", None, prompt, SamplingParams(n=4, seed=11, max_tokens=5, ignore_eos=True)
    )
    out = run_all(engine)["n"]
    for c in out.outputs:
        assert c.token_ids == reference(prompt, 5, seed=derive_seed(11, c.index), rule=rule)
    assert out.num_cached_tokens == 3 * 16
    assert engine.stats()["num_prefill_tokens"] == 18 + 3 * 2
    # child 0 prefilled alone; its siblings were admitted once its pages were planned (2 chunk
    # rows per step: two, then one)
    inserted = [len(p["inserted"]) for p in runner.log if p["inserted"]]
    assert inserted == [1, 2, 1]
