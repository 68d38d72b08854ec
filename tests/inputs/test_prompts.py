"""One prompt parser for every front door (`LLM`, `AsyncLLM`): `parse_prompt`'s rules, each bad
prompt's message (tests/entrypoints/test_async_llm.py checks AsyncLLM gives the same)."""

from __future__ import annotations

import pytest

from jaxserve.inputs.prompts import PromptError, parse_prompt, prompt_list


def tokenizer(text):
    if "\ud800" in text:
        raise UnicodeEncodeError("utf-8", text, 0, 1, "surrogates not allowed")
    return {"input_ids": [ord(c) % 50 for c in text]}


def test_the_forms_of_a_prompt():
    assert parse_prompt("ab", tokenizer) == ("ab", [47, 48])
    assert parse_prompt({"prompt": "ab"}, tokenizer) == ("ab", [47, 48])
    assert parse_prompt({"prompt_token_ids": (1, 2)}, None) == (None, [1, 2])
    assert parse_prompt({"prompt": "x", "prompt_token_ids": [3]}, tokenizer) == ("x", [3])
    assert prompt_list("ab") == ["ab"] and prompt_list({"prompt": "a"}) == [{"prompt": "a"}]
    assert prompt_list(p for p in ("a", "b")) == ["a", "b"]


BAD = [
    ({"prompt": "a", "max_tokens": 3}, "unknown prompt field(s) ['max_tokens']", None),
    ({"prompt_token_ids": "1 2"}, "prompt_token_ids must be a list of ints", None),
    ({}, "prompt dict needs 'prompt' or 'prompt_token_ids'", None),
    (7, "a prompt must be a str or a dict, got int", None),
    ("", "prompt is empty", ""),
    ("a\ud800", "cannot tokenize the prompt: UnicodeEncodeError", None),
]


@pytest.mark.parametrize("prompt,message,text", BAD)
def test_a_bad_prompt_names_its_problem(prompt, message, text):
    with pytest.raises(PromptError) as e:
        parse_prompt(prompt, tokenizer)
    assert str(e.value).startswith(message) and e.value.text == text
    with pytest.raises(PromptError, match="text prompts need a tokenizer") as e:
        parse_prompt("hello", None)
    assert e.value.text == "hello"


def test_prompt_list_refuses_bytes_and_non_iterables():
    with pytest.raises(ValueError, match="decode it to a str"):
        prompt_list(b"hi")
    with pytest.raises(ValueError, match="got int"):
        prompt_list(3)
