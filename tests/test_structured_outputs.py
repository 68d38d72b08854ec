"""Structured outputs on the real SmolLM2-135M-Instruct through `LLM`: every output follows its
JSON schema (checked with `jsonschema`), matches its regex in full, is one of its choices or
parses under its Lark grammar; constrained and unconstrained requests in one batch do not affect
each other; a bad constraint fails alone. The ported vLLM cases name their test in the docstring.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from jaxserve import SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.smollm2

KW = dict(dtype="float32", num_slots=8, max_model_len=384)
SCHEMA = {  # vLLM's tests/v1/entrypoints/conftest.py `sample_json_schema`, trimmed
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer"},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "skills"],
    "additionalProperties": False,
}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
CHOICES = ["Python", "Java", "JavaScript", "C++", "C#", "PHP", "TypeScript", "Ruby", "Swift"]
GRAMMAR = """
start: "SELECT " column " FROM " table ";"
column: "name" | "age" | "id"
table: "users" | "orders"
"""


def _chat(q: str) -> list[dict]:
    return [{"role": "user", "content": q}]


@pytest.fixture(scope="module")
def llm():
    from jaxserve import LLM

    return LLM(**KW)


def _so(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kw)


def test_every_kind_of_constraint_holds_greedy_and_sampled(llm):
    """vLLM tests/v1/entrypoints/llm/test_struct_output_generate.py (json, regex, choice,
    grammar, json_object): each output parses / matches in full, greedy and at temperature 1."""
    cases = [
        ("Give a person as JSON.", _so(json=SCHEMA), "schema"),
        ("Give a person as JSON.", _so(json=json.dumps(SCHEMA)), "schema"),
        ("Write a phone number.", _so(regex=PHONE), "regex"),
        ("Which language is best?", _so(choice=CHOICES), "choice"),
        ("Write an SQL query.", _so(grammar=GRAMMAR), "sql"),
        (
            'Is the sky blue? Answer with a JSON object like {"answer": "yes"}.',
            _so(json_object=True),
            "object",
        ),
    ]
    sps = []
    for _, so, _ in cases:
        sps.append(SamplingParams(temperature=0, max_tokens=96, structured_outputs=so))
    for i, (_, so, _) in enumerate(cases):
        sps.append(SamplingParams(temperature=1.0, seed=i, max_tokens=96, structured_outputs=so))
    outs = llm.chat([_chat(q) for q, _, _ in cases] * 2, sps, use_tqdm=False)
    sql = re.compile(r"SELECT (name|age|id) FROM (users|orders);")
    for out, (_, _, kind) in zip(outs, cases * 2):
        assert out.error is None
        c = out.outputs[0]
        assert c.finish_reason == "stop", (kind, c.text)  # complete, ended by EOS
        if kind == "schema":
            jsonschema.validate(json.loads(c.text), SCHEMA)
        elif kind == "object":
            assert isinstance(json.loads(c.text), dict)
        elif kind == "regex":
            assert re.fullmatch(PHONE, c.text), c.text
        elif kind == "choice":
            assert c.text in CHOICES
        else:
            assert sql.fullmatch(c.text), c.text


def test_constrained_and_unconstrained_in_one_batch_do_not_affect_each_other(llm):
    """Each request in a mixed batch gives what it gives alone (greedy and seeded): the mask
    touches only its own slot, and the unconstrained rows' sampling is untouched."""
    prompts = [_chat("Tell me about the sea."), _chat("Give a person as JSON."), _chat("Hi!")]
    sps = [
        SamplingParams(temperature=0, max_tokens=24),
        SamplingParams(temperature=0.8, seed=7, max_tokens=64, structured_outputs=_so(json=SCHEMA)),
        SamplingParams(temperature=0.8, seed=3, max_tokens=24),
    ]
    together = llm.chat(prompts, sps, use_tqdm=False)
    for p, sp, out in zip(prompts, sps, together):
        alone = llm.chat([p], sp, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    jsonschema.validate(json.loads(together[1].outputs[0].text), SCHEMA)
    # the constraint really constrains: the same request without it says something else
    constrained = llm.chat([prompts[1]], sps[1].clone(), use_tqdm=False)
    plain = SamplingParams(temperature=0.8, seed=7, max_tokens=64)
    assert llm.chat([prompts[1]], plain, use_tqdm=False)[0].outputs[0].text != (
        constrained[0].outputs[0].text
    )


def test_logprobs_are_those_of_the_masked_distribution(llm):
    """As vLLM (the bitmask is applied before the sampler computes log-probs): every top entry
    of a choice-constrained step is an allowed token, and the probabilities sum to ~1 over them."""
    sp = SamplingParams(
        temperature=0, max_tokens=4, logprobs=5, structured_outputs=_so(choice=["yes", "no"])
    )
    out = llm.chat([_chat("Is the sky blue?")], sp, use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes", "no")
    first = out.logprobs[0]
    finite = {t: lp for t, lp in first.items() if lp.logprob > -1e30}
    allowed = {llm.tokenizer.decode([t]) for t in finite}
    assert all("yes".startswith(a) or "no".startswith(a) for a in allowed), allowed
    assert abs(sum(2.718281828**lp.logprob for lp in finite.values()) - 1) < 1e-3


def test_n_samples_each_follow_the_schema_and_a_bad_constraint_fails_alone(llm):
    """n > 1 children each get their own grammar state; a regex that does not compile is that
    prompt's error output (vLLM raises; jaxserve's per-prompt errors, see llm.py)."""
    good = SamplingParams(
        n=3, temperature=1.0, seed=11, max_tokens=96, structured_outputs=_so(json=SCHEMA)
    )
    bad = SamplingParams(temperature=0, max_tokens=8, structured_outputs={"regex": "[a-"})
    outs = llm.chat([_chat("Give a person as JSON."), _chat("x")], [good, bad], use_tqdm=False)
    assert outs[0].error is None and len(outs[0].outputs) == 3
    for c in outs[0].outputs:
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert outs[1].error.startswith("structured_outputs.regex:")
    assert "unclosed character class" in outs[1].error


def test_params_rules():
    """vLLM's StructuredOutputsParams: exactly one constraint; the dict form; unknown keys."""
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="2 are"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="unknown structured_outputs field 'jsn'"):
        SamplingParams(structured_outputs={"jsn": {}})
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{nope")
    with pytest.raises(ValueError, match="list of strings"):
        StructuredOutputsParams(choice="abc")
    with pytest.raises(ValueError, match="not supported"):
        StructuredOutputsParams(structural_tag="{}")
    sp = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert sp.structured_outputs == StructuredOutputsParams(choice=("a", "b"))
    assert sp.clone() == sp and sp.clone().structured_outputs == sp.structured_outputs


def test_constraints_are_bounded_before_compiling():
    """Issue 58: a JSON text nested 5,000 deep raised RecursionError (a plain-text 500 from the
    server), and 100,000 choices took the grammar library 7-8 s before failing with a Rust panic:
    each is now a ValueError naming the field, at once."""
    deep_text = "[" * 5000 + "]" * 5000
    with pytest.raises(ValueError, match="structured_outputs.json is nested deeper than 128"):
        StructuredOutputsParams(json=deep_text)
    deep: dict = {"type": "string"}
    for _ in range(200):
        deep = {"type": "array", "items": deep}
    with pytest.raises(ValueError, match="nested deeper than 128"):
        SamplingParams(structured_outputs={"json": deep})
    with pytest.raises(ValueError, match="choice has 100000 alternatives, more than 4096"):
        StructuredOutputsParams(choice=[f"c{i}" for i in range(100_000)])
    with pytest.raises(ValueError, match="structured_outputs.regex has"):
        StructuredOutputsParams(regex="a" * ((1 << 20) + 1))


def test_a_grammar_that_fails_during_generation_is_the_requests_error(llm):
    """Issue 58: a regex the grammar library cannot follow to its end (a{1000000}: it hits one
    of its limits mid-generation) ended with finish_reason 'abort' and no error, so the client
    saw a short answer as a success. The request now ends with finish_reason 'error' and an
    error naming structured_outputs; another prompt in the batch is unaffected."""
    sp = SamplingParams(temperature=0, max_tokens=64, structured_outputs=_so(regex="a{1000000}"))
    plain = SamplingParams(temperature=0, max_tokens=8)
    bad, good = llm.generate(["Say a.", "Say hi."], [sp, plain], use_tqdm=False)
    assert good.error is None and good.outputs[0].finish_reason in ("length", "stop")
    # llguidance 1.x: "lexer error: too many expressions constructed" after the first token
    assert bad.error is not None and bad.error.startswith("structured_outputs"), bad
    assert "during generation" in bad.error and bad.outputs[0].finish_reason == "error"


def test_engine_rules_no_tokenizer_and_multi_step_decode():
    """A model without a tokenizer cannot take a grammar; decode_steps > 1 is refused (each
    token's mask depends on the one before it). Both are the request's error, not a crash."""
    from jaxserve import LLM

    kw = dict(load_format="dummy", dtype="float32", num_slots=2, max_model_len=32)
    sp = SamplingParams(temperature=0, max_tokens=4, structured_outputs={"regex": "a+"})
    prompt = {"prompt_token_ids": [1, 2, 3]}
    out = LLM("tiny", **kw).generate([prompt], sp, use_tqdm=False)[0]
    assert out.error == "structured_outputs need a tokenizer; this model has none"
    out = LLM("tiny", decode_steps=2, **kw).generate([prompt], sp, use_tqdm=False)[0]
    assert "decode_steps=1" in out.error
