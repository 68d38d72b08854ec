"""`render_chat`, the one chat-template rule of LLM.chat, the server and the batch job, on the
real SmolLM2 template: vLLM's `LLM.chat` options (vllm/entrypoints/llm.py `chat`, and the
continue_final_message / add_generation_prompt check of vllm/entrypoints/chat_utils.py)."""

from __future__ import annotations

import pytest

from jaxserve.inputs.chat import render_chat

pytestmark = pytest.mark.smollm2

CONV = [{"role": "user", "content": "Name three colors."}]
PARTIAL = CONV + [{"role": "assistant", "content": "Red, green and"}]


@pytest.fixture(scope="module")
def tok(smollm2_gguf_path):
    from jaxserve.loading import gguf_file
    from jaxserve.loading.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_gguf_path, reader=gguf_file.open_gguf(smollm2_gguf_path))


def test_generation_prompt_opens_an_assistant_turn(tok):
    text, ids = render_chat(tok, CONV)
    assert text.endswith("<|im_start|>assistant\n")
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    closed, _ = render_chat(tok, CONV, add_generation_prompt=False)
    assert text.startswith(closed) and not closed.endswith("assistant\n")


def test_continue_final_message_leaves_the_last_turn_open(tok):
    text, _ = render_chat(tok, PARTIAL, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nRed, green and")  # no <|im_end|> after it
    closed, _ = render_chat(tok, PARTIAL, add_generation_prompt=False)
    assert closed.rstrip().endswith("Red, green and<|im_end|>")
    with pytest.raises(ValueError, match="cannot both be True"):
        render_chat(tok, PARTIAL, continue_final_message=True)


def test_chat_template_kwargs_are_variables_and_override_the_options(tok):
    template = "{{ greeting }} {% for m in messages %}{{ m.content }}{% endfor %}"
    template += "{% if add_generation_prompt %}|gen{% endif %}"
    text, _ = render_chat(
        tok, CONV, chat_template=template, chat_template_kwargs={"greeting": "Hi"}
    )
    assert text == "Hi Name three colors.|gen"
    text, _ = render_chat(
        tok,
        CONV,
        chat_template=template,
        chat_template_kwargs={"greeting": "Hi", "add_generation_prompt": False},
    )
    assert text == "Hi Name three colors."
    with pytest.raises(ValueError, match="may not set"):
        render_chat(tok, CONV, chat_template_kwargs={"tokenize": True})


def test_tools_reach_the_template(tok):
    template = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{{ messages[0].content }}"
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    text, _ = render_chat(tok, CONV, chat_template=template, tools=tools)
    assert text == "[get_weather]Name three colors."


def test_assistant_tool_calls_reach_the_template_with_mapping_arguments(tok):
    """vLLM's rule: OpenAI's JSON-string arguments become a mapping ({} where they are not a JSON
    object); an empty tool_calls list is dropped; a call that is not a function is an error."""
    template = (
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<{{ c.function.name }} "
        "{{ c.function.arguments | tojson }} {{ 'dict' if c.function.arguments is mapping }}>"
        "{% endfor %}{{ 'T' if 'tool_calls' in m else '' }}|{% endfor %}"
    )
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    conv = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [
            call,
            {**call, "function": {"name": "g", "arguments": "[1]"}},
            {**call, "function": {"name": "h", "arguments": "not json"}},
            {**call, "function": {"name": "k", "arguments": {"b": 2}}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "assistant", "content": "done", "tool_calls": []},
    ]  # fmt: skip
    text, _ = render_chat(tok, conv, chat_template=template, add_generation_prompt=False)
    assert text == (
        'user:q|assistant:<f {"a": 1} dict><g {} dict><h {} dict><k {"b": 2} dict>T|'
        "tool:42|assistant:done|"
    )
    assert conv[1]["tool_calls"][0] is call and call["function"]["arguments"] == '{"a": 1}'
    for bad in ({"type": "custom", "function": {"name": "f"}}, {"type": "function"}, "x"):
        with pytest.raises(ValueError, match=r"messages\[1\]\.tool_calls\[0\]"):
            render_chat(
                tok, [conv[0], {"role": "assistant", "tool_calls": [bad]}], chat_template=template
            )


def test_content_parts_render_as_vllm_joins_them(tok):
    """vLLM's "string" content format: text parts joined by newlines (a string part counts; one
    without its text is skipped); an image or a part without a type is an error naming it."""
    parts = [{"type": "text", "text": "Name three"}, "colors", {"type": "text"}]
    joined = [{"role": "user", "content": "Name three\ncolors"}]
    assert render_chat(tok, [{"role": "user", "content": parts}]) == render_chat(tok, joined)
    assert render_chat(tok, [{"role": "user"}]) == render_chat(
        tok, [{"role": "user", "content": ""}]
    )
    image = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    with pytest.raises(
        ValueError, match=r"messages\[0\]\.content\[1\] is of type 'image_url'.*text only"
    ):
        render_chat(tok, [{"role": "user", "content": [parts[0], image]}])
    with pytest.raises(ValueError, match=r"messages\[1\]\.content\[0\] has no 'type'"):
        render_chat(tok, CONV + [{"role": "user", "content": [{"text": "x"}]}])
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]\.text must be a string"):
        render_chat(tok, [{"role": "user", "content": [{"type": "text", "text": 5}]}])
