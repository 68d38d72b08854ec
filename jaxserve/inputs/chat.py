"""Rendering a conversation through the model's chat template, one rule for every caller
(`LLM.chat`, the OpenAI server's chat completions, the batch job's message rows):

    render_chat(tokenizer, conversation, *, chat_template, add_generation_prompt,
                continue_final_message, tools, chat_template_kwargs) -> (text, token ids)

As in vLLM's `LLM.chat`: `chat_template_kwargs` are passed to the template last, so they override
the named options; `continue_final_message` leaves the final message open (no end-of-turn) for
the model to continue, and cannot be combined with `add_generation_prompt`; `tools` (OpenAI tool
definitions) are given to templates that render them. The text is tokenized without adding
special tokens again (the template already holds them).

A message's content may be a string or OpenAI's list of content parts. As vLLM's "string" content
format, a list becomes its text parts joined by newlines before the template sees it (a part
whose text is missing is skipped, as vLLM does); a missing content becomes "". An assistant
message's `tool_calls` reach the template with their arguments as a mapping (vLLM's rule). The
models served take text only, so an image, audio, video or file part is an error naming it,
never dropped in silence.
"""

from __future__ import annotations

import json
from typing import Any

RESERVED = (
    "conversation",
    "tokenize",
    "return_dict",
)  # apply_chat_template's own, never a variable


# vLLM's text-like content part types, each with the key holding its text
TEXT_PART_KEYS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}


def message_text(content: Any, where: str = "content") -> str:
    """One message's content as the template's string; ValueError naming the bad part."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(
            f"{where} must be a string or a list of content parts, not {type(content).__name__}"
        )
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise ValueError(
                f"{where}[{j}] must be a content part object, not {type(part).__name__}"
            )
        kind = part.get("type")
        if kind not in TEXT_PART_KEYS:
            what = "has no 'type'" if kind is None else f"is of type {kind!r}"
            raise ValueError(
                f"{where}[{j}] {what}; this model takes text only (content parts of type "
                f"{', '.join(repr(k) for k in TEXT_PART_KEYS)})"
            )
        text = part.get(TEXT_PART_KEYS[kind])
        if text is None:
            continue  # vLLM skips a text part without its text
        if not isinstance(text, str):
            raise ValueError(f"{where}[{j}].{TEXT_PART_KEYS[kind]} must be a string")
        texts.append(text)
    return "\n".join(texts)


def normalize_conversation(conversation: Any) -> list[dict[str, Any]]:
    """The messages with each content a string (`message_text`); ValueError naming the bad one."""
    if not isinstance(conversation, list):
        raise ValueError(f"messages must be a list, not {type(conversation).__name__}")
    out = []
    for i, message in enumerate(conversation):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be an object, not {type(message).__name__}")
        content = message_text(message.get("content"), f"messages[{i}].content")
        message = {**message, "content": content}
        if message.get("role") == "assistant" and isinstance(message.get("tool_calls"), list):
            _tool_calls_as_dicts(message, f"messages[{i}].tool_calls")
        out.append(message)
    return out


def _tool_calls_as_dicts(message: dict[str, Any], where: str) -> None:
    """As vLLM (and transformers' templates expect): an assistant message's tool calls carry
    their arguments as a mapping, not OpenAI's JSON string. Arguments that are not a JSON object
    become {} (history the next turn must still render); no calls at all, the key dropped."""
    calls = message["tool_calls"]
    if not calls:
        del message["tool_calls"]
        return
    fixed = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise ValueError(f"{where}[{j}] must be a tool call of type 'function'")
        args = function.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args else {}
            except ValueError:
                args = {}
        args = args if isinstance(args, dict) else {}
        fixed.append({**call, "function": {**function, "arguments": args}})
    message["tool_calls"] = fixed


def render_chat(
    tokenizer: Any,
    conversation: list[dict[str, Any]],
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    max_chars: int | None = None,
) -> tuple[str, list[int]]:
    """(text, token ids) of one conversation; ValueError naming what is wrong with the request
    (max_chars: the longest rendered text accepted, checked before it is tokenized)."""
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer; this model has none")
    kwargs = dict(
        chat_template=chat_template,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tools=tools,
    )
    extra = dict(chat_template_kwargs or {})
    bad = sorted(k for k in extra if k in RESERVED or not isinstance(k, str))
    if bad:
        raise ValueError(f"chat_template_kwargs may not set {bad}")
    kwargs.update(extra)
    if kwargs["continue_final_message"] and kwargs["add_generation_prompt"]:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be True")
    conversation = normalize_conversation(conversation)
    if kwargs["continue_final_message"] and not conversation:
        raise ValueError("continue_final_message needs a final message to continue")
    if kwargs["chat_template"] is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model's tokenizer has no chat template; pass chat_template")
    defaults = {"chat_template": None, "continue_final_message": False, "tools": None}
    kwargs = {k: v for k, v in kwargs.items() if k not in defaults or v != defaults[k]}
    text = tokenizer.apply_chat_template(conversation, tokenize=False, **kwargs)
    if not isinstance(text, str):
        raise ValueError(f"the chat template gave a {type(text).__name__}, not a str")
    if max_chars is not None and len(text) > max_chars:
        raise ValueError(f"the rendered prompt has {len(text)} characters, over {max_chars}")
    return text, [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]
