"""tool_calls.ToolUse (vLLM's tool_choice checks, the schemas, the parse of a finished output) and
ToolCallStream (the streamed view: whatever the chunks, its deltas join into the parse)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from jaxserve.entrypoints.openai.tool_calls import ToolCallStream, ToolError, ToolUse

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters
TOOLS = [WEATHER, TIME]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize(
    "tools, choice, param",
    [
        ([], None, "tools"),  # an empty list, as OpenAI and vLLM refuse it
        (None, "required", "tool_choice"),  # a choice without tools
        (None, NAMED, "tool_choice"),
        (TOOLS, "sometimes", "tool_choice"),
        (TOOLS, {"type": "function"}, "tool_choice.function"),
        (TOOLS, {"type": "function", "function": {"name": ""}}, "tool_choice.function.name"),
        (TOOLS, {"type": "function", "function": {"name": 5}}, "tool_choice.function.name"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        (TOOLS, "auto", "tool_choice"),  # no parser on this server
        (TOOLS, None, "tool_choice"),  # tools without tool_choice mean "auto"
        ([{"type": "function"}], "none", "tools"),  # no function
        ([{"type": "function", "function": {"name": 3}}], "none", "tools"),
        ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "none", "tools"),
    ],
)
def test_bad_tool_use_names_the_field(tools, choice, param):
    with pytest.raises(ToolError) as e:
        ToolUse.of(tools, choice)
    assert e.value.param == param, str(e.value)


def test_modes_and_their_schemas():
    assert ToolUse.of(None, None).mode == "none"
    none = ToolUse.of(TOOLS, "none")
    assert none.mode == "none" and not none.constrains
    assert none.parse("hello") == ("hello", [])

    named = ToolUse.of(TOOLS, NAMED)
    assert named.mode == "named" and named.schema == WEATHER["function"]["parameters"]
    content, calls = named.parse('{"city": "Paris"}')
    assert content == "" and len(calls) == 1
    call = calls[0]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert named.finish_reason("stop", True) == "stop"  # a named function keeps its reason
    assert ToolUse.of(TOOLS, {"type": "function", "function": {"name": "get_time"}}).schema == {
        "type": "object",
        "properties": {},
    }

    required = ToolUse.of(TOOLS, "required")
    schema = required.schema
    good = [{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]  # fmt: skip
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "x", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    content, calls = required.parse(json.dumps(good))
    assert content == "" and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert required.finish_reason("stop", True) == "tool_calls"
    assert required.finish_reason("length", False) == "length"
    assert required.parse('[{"name": "get_wea') == ("", [])  # cut short: no call

    single = ToolUse.of(TOOLS, "required", parallel_tool_calls=False)
    assert single.schema["maxItems"] == 1
    assert len(single.parse(json.dumps(good))[1]) == 1


def test_required_hoists_defs_and_refuses_conflicting_ones():
    def tool(name, defs):
        params = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": defs}
        return {"type": "function", "function": {"name": name, "parameters": params}}

    point = {"P": {"type": "integer"}}
    schema = ToolUse.of([tool("a", point), tool("b", point)], "required").schema
    assert schema["$defs"] == point
    jsonschema.validate([{"name": "b", "parameters": {"p": 3}}], schema)
    for bad in ([tool("a", point), tool("b", {"P": {"type": "string"}})], [tool("a", 5)]):
        with pytest.raises(ToolError) as e:
            ToolUse.of(bad, "required")
        assert e.value.param == "tools"


HERMES = ToolUse.of(TOOLS, "auto", parser="hermes", auto=True)


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("Just text.", "Just text.", []),
        (
            'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>',
            "Let me check. ",
            [("get_weather", {"city": "Rome"})],
        ),
        (
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}',  # the last unterminated
            None,
            [("get_weather", {"city": "Rome"}), ("get_time", {})],
        ),
        ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ],
)
def test_hermes_parse(text, content, calls):
    got_content, got = HERMES.parse(text)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
    assert HERMES.finish_reason("stop", bool(got)) == ("tool_calls" if calls else "stop")


LLAMA = ToolUse.of(TOOLS, "auto", parser="llama3_json", auto=True)


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("Just text.", "Just text.", []),
        ('{"name": "get_weather", "parameters": {"city": "Rome"}}', None, [("get_weather", {"city": "Rome"})]),
        (
            '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Rome"}}; '
            '{"name": "get_time", "parameters": {}}',
            None,
            [("get_weather", {"city": "Rome"}), ("get_time", {})],
        ),
        ('Sure: {"name": "get_time", "parameters": {}}', None, [("get_time", {})]),
        ('{"name": "get_time"}', '{"name": "get_time"}', []),  # no arguments: not a call
        ('{"city": "Rome"}', '{"city": "Rome"}', []),
        ('{"name": 5, "parameters": {}}', '{"name": 5, "parameters": {}}', []),
        ("a { b", "a { b", []),
    ],
)  # fmt: skip
def test_llama3_json_parse(text, content, calls):
    got_content, got = LLAMA.parse(text)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls


PYTHONIC = ToolUse.of(TOOLS, "auto", parser="pythonic", auto=True)


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("Just text.", "Just text.", []),
        ('[get_weather(city="Rome")]', None, [("get_weather", {"city": "Rome"})]),
        (
            "[get_weather(city='Rome', days=-2, hourly=true, unit=None, at=(1, 2.5), tags={'a'}, "
            "opts={'x': [null, false]}, note=f'hi'), get_time()]",
            None,
            [
                ("get_weather", {"city": "Rome", "days": -2, "hourly": True, "unit": None,
                                 "at": [1, 2.5], "tags": ["a"], "opts": {"x": [None, False]}, "note": "hi"}),
                ("get_time", {}),
            ],
        ),
        ("[tools.search(q='x')]", None, [("tools.search", {"q": "x"})]),
        ("[1, 2] are numbers.", "[1, 2] are numbers.", []),
        ("[get_weather('Rome')]", "[get_weather('Rome')]", []),  # positional: not a call
        ("[get_weather(city=rome)]", "[get_weather(city=rome)]", []),  # a variable
        ("[get_weather(city=open('x'))]", "[get_weather(city=open('x'))]", []),  # a call
        ("[get_weather(**kw)]", "[get_weather(**kw)]", []),
        ("[get_time(), 5]", "[get_time(), 5]", []),
        ("[get_time()] and more", "[get_time()] and more", []),
        ("[get_time(", "[get_time(", []),  # cut short
        (" [get_time()]", " [get_time()]", []),  # a call list starts the reply
        ("Sure: [get_time()]", "Sure: [get_time()]", []),
    ],
)  # fmt: skip
def test_pythonic_parse(text, content, calls):
    got_content, got = PYTHONIC.parse(text)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls


MISTRAL = ToolUse.of(TOOLS, "auto", parser="mistral", auto=True)


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("Just text.", "Just text.", []),
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "get_time", "arguments": {}}]',
         None, [("get_weather", {"city": "Rome"}), ("get_time", {})]),
        ('Let me see. [TOOL_CALLS] {"name": "get_time", "arguments": "{}"} and then', "Let me see. ", [("get_time", {})]),
        ('[TOOL_CALLS][{"name": "get_time", "arguments": {}}, 7, {"city": "x"}]', None, [("get_time", {})]),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]get_time{} trailing words',
         None, [("get_weather", {"city": "Rome"}), ("get_time", {})]),
        ("[TOOL_CALLS]get_weather[ARGS]not json", "[TOOL_CALLS]get_weather[ARGS]not json", []),
        ('[TOOL_CALLS]{"name": 5}', '[TOOL_CALLS]{"name": 5}', []),
        ("[TOOL_CALLS]", "[TOOL_CALLS]", []),
    ],
)  # fmt: skip
def test_mistral_parse(text, content, calls):
    got_content, got = MISTRAL.parse(text)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in got)  # Mistral's templates ask


def test_pythonic_content_streams_unless_the_reply_opens_a_list():
    """A pythonic call can only open the reply, so words stream as they come, brackets and all;
    a reply that opens with "[" is held back until it is finished."""
    words = "See [1] and [get_time()]"
    stream = ToolCallStream(PYTHONIC)
    assert stream.update(words[:5], False) == ("See [", [])
    assert stream.update(words, True) == (words[5:], [])
    stream = ToolCallStream(PYTHONIC)
    assert stream.update("[get_ti", False) == (None, [])
    delta, calls = stream.update("[get_time()]", True)
    assert delta is None and [c["function"]["name"] for c in calls] == ["get_time"]


def test_a_call_name_that_is_not_a_string_is_no_call():
    assert HERMES.parse('<tool_call>{"name": 5, "arguments": {}}</tool_call>')[1] == []
    assert HERMES.parse("<tool_call>[1]</tool_call>")[1] == []


def _joined(use, text, cuts):
    """Stream `text` in pieces ending at `cuts`; returns (content, calls) as a client joins them."""
    stream, content, calls = ToolCallStream(use), [], {}
    ends = sorted(set(cuts) | {len(text)})
    for end in ends:
        delta, deltas = stream.update(text[:end], end == len(text))
        content.append(delta or "")
        for d in deltas:
            call = calls.setdefault(d["index"], {"name": "", "arguments": ""})
            if "id" in d:
                assert call["name"] == "" and len(d["id"]) >= 9
            fn = d.get("function") or {}
            call["name"] += fn.get("name") or ""
            call["arguments"] += fn.get("arguments") or ""
    return "".join(content), [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize(
    "use, text",
    [
        (ToolUse.of(TOOLS, "none"), "Plain words <tool_call> stay text."),
        (ToolUse.of(TOOLS, NAMED), '{"city": "Paris"}'),
        (ToolUse.of(TOOLS, "required"), '[{"name": "get_time", "parameters": {}}]'),
        (ToolUse.of(TOOLS, "required"),
         '[{"name": "get_weather", "parameters": {"city": "X, {[Y]}"}}, {"name": "get_time", "parameters": {}}]'),
        (ToolUse.of(TOOLS, "required", parallel_tool_calls=False),
         '[{"name": "get_weather", "parameters": {"city": "X"}}, {"name": "get_time", "parameters": {}}]'),
        (HERMES, 'Sure. <tool_call>{"name": "get_time", "arguments": {}}</tool_call> trailing'),
        (HERMES, 'A <tool_ca b <tool_call>{"name": "get_weather", "arguments": {"city": "X"}}'),
        (HERMES, "No call, but a < and <tool_c at the end <tool_c"),
        (HERMES, "<tool_call>{broken</tool_call>"),
        (LLAMA, '{"name": "get_weather", "parameters": {"city": "X"}}; {"name": "get_time", "parameters": {}}'),
        (LLAMA, '<|python_tag|>{"name": "get_time", "parameters": {}}'),
        (LLAMA, "Plain words, and <|python_ at the end <|py"),
        (LLAMA, "Words then {not json"),
        (PYTHONIC, "[get_weather(city='X'), get_time()]"),
        (PYTHONIC, "Plain [words] (and more)"),
        (PYTHONIC, "[1, 2]"),
        (MISTRAL, 'Sure. [TOOL_CALLS][{"name": "get_time", "arguments": {}}]'),
        (MISTRAL, '[TOOL_CALLS]get_weather[ARGS]{"city": "X"}[TOOL_CALLS]get_time{}'),
        (MISTRAL, "No call, but [TOOL_ at the end [TOOL_CA"),
    ],
)  # fmt: skip
def test_streamed_deltas_join_into_the_parse(use, text):
    """Every way of cutting the text into 1-, 2- and 5-character chunks, and in one piece."""
    content, calls = use.parse(text)
    want = [dict(c["function"]) for c in calls]
    for step in (1, 2, 5, len(text)):
        got_content, got_calls = _joined(use, text, range(step, len(text), step))
        assert got_content == (content or ""), step
        assert got_calls == want, step


def test_required_streams_each_call_as_its_object_closes():
    text = '[{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "get_time", "parameters": {}}]'
    first = text.index("}}") + 2
    stream = ToolCallStream(ToolUse.of(TOOLS, "required"))
    assert stream.update(text[: first - 1], False) == (None, [])
    _, calls = stream.update(text[:first], False)
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_weather")]
    assert stream.update(text[: first + 3], False) == (None, [])
    _, calls = stream.update(text, True)
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(1, "get_time")]


def test_a_streamed_tool_call_fragment_leaves_out_its_unset_fields():
    """The openai client's stream helper merges fragments key by key, and a null "type" would
    overwrite the first fragment's "function"."""
    from jaxserve.entrypoints.openai.protocol.chat import (
        DeltaFunctionCall,
        DeltaMessage,
        DeltaToolCall,
    )

    later = DeltaToolCall(index=0, function=DeltaFunctionCall(arguments='"x"'))
    msg = json.loads(DeltaMessage(tool_calls=[later]).model_dump_json())
    assert msg["tool_calls"] == [{"index": 0, "function": {"arguments": '"x"'}}]


def test_llama3_json_streamed_keeps_the_words_before_the_calls():
    """The one place a stream differs from the whole reply (tool_calls.py's docstring): words
    already sent before the first JSON object stay sent."""
    text = 'Sure: {"name": "get_time", "parameters": {}}'
    assert LLAMA.parse(text)[0] is None
    for step in (1, 3, len(text)):
        content, calls = _joined(LLAMA, text, range(step, len(text), step))
        assert content == "Sure: " and [c["name"] for c in calls] == ["get_time"]


def test_an_explicit_null_tool_choice_is_none_and_a_missing_one_is_the_default():
    """As vLLM: tools without tool_choice mean "auto"; `"tool_choice": null` calls no tool (many
    clients send every field, unset ones as null)."""
    from jaxserve.entrypoints.openai.protocol.chat import ChatCompletionRequest

    msgs = [{"role": "user", "content": "hi"}]
    given = ChatCompletionRequest.model_validate({"messages": msgs, "tools": TOOLS})
    null = ChatCompletionRequest.model_validate(
        {"messages": msgs, "tools": TOOLS, "tool_choice": None, "parallel_tool_calls": None}
    )
    assert given.tool_choice_given is None and null.tool_choice_given == "none"
    with pytest.raises(ToolError):  # "auto", and this server has no parser
        ToolUse.of(given.tools, given.tool_choice_given)
    assert ToolUse.of(null.tools, null.tool_choice_given).mode == "none"
    assert null.parallel_tool_calls is None
