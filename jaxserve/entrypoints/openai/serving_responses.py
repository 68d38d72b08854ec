"""POST /v1/responses: OpenAI's Responses API for text, as the `openai` client's
`client.responses.create(...)` and agent frameworks built on it call it.

`instructions` becomes a system message before `input` (a string: one user message; or a list
of messages, {"role", "content"} with or without "type": "message", content a string or text
parts), then the chat template, then one engine request, as a chat completion. The reply is one
output message with one `output_text` part; `status` is "incomplete" (reason
"max_output_tokens") when the output hit its token limit. `text.format` (json_object or
json_schema) is a structured output. `usage.input_tokens_details.cached_tokens` counts the prompt
tokens the prefix cache held. Streamed (`stream: true`), the events are OpenAI's, each with its
`sequence_number`: response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.output_text.delta (one per engine output),
response.output_text.done, response.content_part.done, response.output_item.done, then
response.completed or response.incomplete; an error after the stream began is an `error` event.

Not served, each a 400 naming its field rather than a silent difference: stored responses
(`previous_response_id`, `conversation`, `background`; every response says `store: false`),
`tools` (chat completions serve them), `include`, `top_logprobs`, `truncation: "auto"`, `n` > 1,
and input items other than messages (function calls and their outputs, images, files).
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator

import pydantic

from jaxserve.entrypoints.openai.protocol import (
    ChatMessage,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from jaxserve.entrypoints.openai.serving import (
    APIError,
    ServingState,
    check_prompt,
    check_request,
    check_unserved,
    deadline,
    generate_all,
    make_sampling_params,
    truncate,
)
from jaxserve.entrypoints.openai.serving_chat import apply_template

ROLES = ("user", "system", "developer", "assistant")


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


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
    if req.tools:
        raise APIError(
            400, "tools are not served on /v1/responses; /v1/chat/completions serves them", "tools"
        )
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


def to_messages(req: ResponsesRequest) -> list[ChatMessage]:
    """The chat messages of `instructions` and `input`; 400 naming the bad item."""
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    if not items:
        raise APIError(400, "input must not be empty", "input")
    messages = []
    if req.instructions is not None:
        messages.append(ChatMessage(role="system", content=req.instructions))
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind != "message":
            raise APIError(
                400,
                f"input[{i}] is of type {kind!r}; this server takes messages only "
                "(type 'message': role and content)",
                "input",
            )
        if item.get("role") not in ROLES:
            raise APIError(400, f"input[{i}].role must be one of {', '.join(ROLES)}", "input")
        try:
            messages.append(
                ChatMessage.model_validate({"role": item["role"], "content": item.get("content")})
            )
        except pydantic.ValidationError as e:
            raise APIError(400, f"input[{i}].content: {e.errors()[0]['msg']}", "input") from None
    return messages


async def create_response(state: ServingState, req: ResponsesRequest):
    """The response object, or (stream=True) an async iterator of SSE strings."""
    state.check_model(req.model)
    check_unserved(req)
    check_responses_unserved(req)
    try:
        text, ids = apply_template(state, to_messages(req))
    except APIError as e:
        if e.param == "messages":
            e.param = "input"
        raise
    text, ids = truncate(state, req, text, ids)
    asked = req.max_output_tokens if req.max_output_tokens is not None else req.max_tokens
    try:
        max_tokens = check_prompt(state, ids, asked, state.max_model_len)
    except APIError as e:
        e.param = {"prompt": "input", "max_tokens": "max_output_tokens"}.get(e.param, e.param)
        raise
    sp = make_sampling_params(state, req, max_tokens=max_tokens)
    await check_request(state, req, ids, sp)
    shell = _shell(state, req, _id("resp"))
    if req.stream:
        return _events(_stream(state, text, ids, sp, shell))
    final = None
    async with deadline(state):
        async with contextlib.aclosing(generate_all(state, [(text, ids)], [sp], False)) as outs:
            async for _, out in outs:
                final = out
    return _finished(shell, _id("msg"), final)


def _shell(state: ServingState, req: ResponsesRequest, rid: str) -> ResponseObject:
    """The response as created: in progress, no output yet, echoing the request's settings."""
    fmt = req.text.format if req.text is not None and req.text.format is not None else None
    return ResponseObject(
        id=rid,
        status="in_progress",
        model=state.model_name,
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        metadata=req.metadata,
        parallel_tool_calls=req.parallel_tool_calls,
        temperature=req.temperature,
        top_p=req.top_p,
        tool_choice=req.tool_choice,
        text={"format": fmt.model_dump(by_alias=True, exclude_none=True)}
        if fmt is not None
        else {"format": {"type": "text"}},
        user=req.user,
    )


def _finished(shell: ResponseObject, mid: str, out) -> ResponseObject:
    c = out.outputs[0]
    status = "incomplete" if c.finish_reason == "length" else "completed"
    message = OutputMessage(id=mid, status=status, content=[OutputText(text=c.text)])
    n_in, n_out = len(out.prompt_token_ids), len(c.token_ids)
    usage = ResponseUsage(
        input_tokens=n_in,
        input_tokens_details={"cached_tokens": out.num_cached_tokens},
        output_tokens=n_out,
        total_tokens=n_in + n_out,
    )
    return shell.model_copy(
        update={
            "status": status,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "output": [message],
            "usage": usage,
        }
    )


async def _stream(state, text, ids, sp, shell: ResponseObject) -> AsyncIterator[dict]:
    """The stream's events (dicts with their "type"), in OpenAI's order."""
    mid = _id("msg")
    at = {"item_id": mid, "output_index": 0, "content_index": 0}
    yield {"type": "response.created", "response": shell.model_dump()}
    yield {"type": "response.in_progress", "response": shell.model_dump()}
    item = OutputMessage(id=mid, status="in_progress")
    yield {"type": "response.output_item.added", "output_index": 0, "item": item.model_dump()}
    part = OutputText(text="")
    yield {"type": "response.content_part.added", **at, "part": part.model_dump()}
    sent, final = 0, None
    async with deadline(state):
        async with contextlib.aclosing(generate_all(state, [(text, ids)], [sp], True)) as outs:
            async for _, out in outs:
                c = out.outputs[0]
                if len(c.text) > sent:
                    yield {"type": "response.output_text.delta", **at,
                           "delta": c.text[sent:], "logprobs": []}  # fmt: skip
                    sent = len(c.text)
                final = out
    done = _finished(shell, mid, final)
    message = done.output[0]
    full = message.content[0].model_dump()
    yield {"type": "response.output_text.done", **at, "text": full["text"], "logprobs": []}
    yield {"type": "response.content_part.done", **at, "part": full}
    yield {"type": "response.output_item.done", "output_index": 0, "item": message.model_dump()}
    yield {"type": f"response.{done.status}", "response": done.model_dump()}


async def _events(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    """The SSE body: `event: <type>` and `data: <json>` per event, numbered; an error after the
    stream began becomes an `error` event (the Responses API sends no [DONE])."""
    seq = 0

    def sse(event: dict) -> str:
        nonlocal seq
        event = {**event, "sequence_number": seq}
        seq += 1
        return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"

    try:
        async with contextlib.aclosing(events):
            async for event in events:
                yield sse(event)
    except APIError as e:
        err = e.body()["error"]
        yield sse({"type": "error", "code": err["code"] or err["type"],
                   "message": err["message"], "param": err["param"]})  # fmt: skip
