"""Rendering a conversation through the model's chat template, one rule for every caller
(`LLM.chat`, the OpenAI server's chat completions, the batch job's message rows):

    render_chat(tokenizer, conversation, *, chat_template, add_generation_prompt,
                continue_final_message, tools, chat_template_kwargs) -> (text, token ids)

As in vLLM's `LLM.chat`: `chat_template_kwargs` are passed to the template last, so they override
the named options; `continue_final_message` leaves the final message open (no end-of-turn) for
the model to continue, and cannot be combined with `add_generation_prompt`; `tools` (OpenAI tool
definitions) are given to templates that render them. The text is tokenized without adding
special tokens again (the template already holds them).
"""

from __future__ import annotations

from typing import Any

RESERVED = (
    "conversation",
    "tokenize",
    "return_dict",
)  # apply_chat_template's own, never a variable


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
