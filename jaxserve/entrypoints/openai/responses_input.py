"""The Responses API's request as a chat completion's: messages, tools and tool use
(serving_responses.py serves it).

`instructions` becomes a system message before `input`: a string (one user message) or a list of
items: messages ({"role", "content"}, with or without "type": "message"; content a string or
text parts), `function_call` items (the model's earlier calls: an assistant message's
tool_calls) and `function_call_output` items (their results: tool messages).

Tools are function tools ({"type": "function", "name", "description", "parameters"}) and
`tool_choice` is served as chat completions serve it (`tool_calls.ToolUse`): a named function
({"type": "function", "name"}) or "required" constrains the output to the tools' schemas;
"auto" (the default with tools) needs the server's --tool_call_parser; "none" gives the template
the tools and returns text.

Not served, each a 400 naming its field rather than a silent difference: stored responses
(`previous_response_id`, `conversation`, `background`; every response says `store: false`),
tools other than functions, `include`, `top_logprobs`, `truncation: "auto"`, `n` > 1, and
input items other than the three above (images, files, reasoning).
"""

from __future__ import annotations

from typing import Any

import pydantic

from jaxserve.entrypoints.openai.protocol.chat import ChatMessage
from jaxserve.entrypoints.openai.protocol.responses import ResponsesRequest
from jaxserve.entrypoints.openai.serving import APIError, ServingState
from jaxserve.entrypoints.openai.tool_calls import ToolError, ToolUse

ROLES = ("user", "system", "developer", "assistant")


def check_responses_unserved(req: ResponsesRequest) -> None:
    """400s for the Responses API fields this server does not provide."""
    if req.previous_response_id is not None or req.conversation is not None:
        field = "previous_response_id" if req.previous_response_id is not None else "conversation"
        raise APIError(
            400,
            f"{field}: this server stores no responses; send the whole conversation in `input`",
            field,
        )
    if req.background:
        raise APIError(400, "background responses are not supported by this server", "background")
    if req.include:
        raise APIError(400, f"include is not supported by this server: {req.include}", "include")
    if req.top_logprobs is not None:
        raise APIError(400, "top_logprobs is not supported on /v1/responses", "top_logprobs")
    if req.truncation == "auto":
        raise APIError(
            400, 'truncation "auto" is not supported; a prompt too long is a 400', "truncation"
        )
    if req.n != 1:
        raise APIError(400, "n must be 1 on /v1/responses", "n")


def chat_tools(req: ResponsesRequest) -> list[dict[str, Any]] | None:
    """The request's function tools in chat completions' form ({"type", "function": {...}});
    None for none (`tools: []` too, which the Responses API accepts)."""
    if not req.tools:
        return None
    tools = []
    for i, tool in enumerate(req.tools):
        if tool.get("type") != "function":
            raise APIError(
                400,
                f"tools[{i}] is of type {tool.get('type')!r}; this server serves function tools "
                "only",
                "tools",
            )
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        tools.append({"type": "function", "function": fn})
    return tools


def tool_use(state: ServingState, req: ResponsesRequest, tools) -> ToolUse:
    """The request's tool use (`tool_calls.ToolUse`, as chat's), or a 400 naming the field."""
    choice = req.tool_choice if "tool_choice" in req.model_fields_set else None
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise APIError(
                400, f"tool_choice of type {choice.get('type')!r} is not served", "tool_choice"
            )
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if tools is None and choice in (None, "auto", "none"):
        choice = "none"  # the API's default "auto" with no tools: text
    try:
        use = ToolUse.of(
            tools,
            choice,
            req.parallel_tool_calls,
            state.tool_call_parser,
            state.enable_auto_tool_choice,
        )
    except ToolError as e:
        raise APIError(400, str(e), e.param) from None
    if use.constrains and req.structured_outputs_kwargs() is not None:
        raise APIError(
            400,
            "You can only either use constraints for structured outputs or tools, not both.",
            "tool_choice",
        )
    return use


def to_messages(req: ResponsesRequest) -> list[ChatMessage]:
    """The chat messages of `instructions` and `input`; 400 naming the bad item."""
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    if not items:
        raise APIError(400, "input must not be empty", "input")
    messages: list[dict[str, Any]] = []
    if req.instructions is not None:
        messages.append({"role": "system", "content": req.instructions})
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            if item.get("role") not in ROLES:
                raise APIError(400, f"input[{i}].role must be one of {', '.join(ROLES)}", "input")
            messages.append({"role": item["role"], "content": item.get("content")})
        elif kind == "function_call":
            _strings(item, i, "call_id", "name", "arguments")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}  # fmt: skip
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            _strings(item, i, "call_id")
            messages.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": item.get("output")}
            )
        else:
            raise APIError(
                400,
                f"input[{i}] is of type {kind!r}; this server takes messages, function_call and "
                "function_call_output items",
                "input",
            )
    try:
        return [ChatMessage.model_validate(m) for m in messages]
    except pydantic.ValidationError as e:
        raise APIError(400, f"input: {e.errors()[0]['msg']}", "input") from None


def _strings(item: dict, i: int, *keys: str) -> None:
    for key in keys:
        if not isinstance(item.get(key), str):
            raise APIError(400, f"input[{i}].{key} must be a string", "input")
