"""POST /v1/responses: OpenAI's Responses API for text and function tools, as the `openai`
client's `client.responses.create(...)` and agent frameworks built on it call it.

The request becomes chat messages and tools (responses_input.py: `instructions` and the `input`
items, function tools and `tool_choice`, the fields not served, each a 400 naming it). Then the
chat template (with the tools), then one engine request, as a chat completion. The output is a
message with one `output_text` part, and a `function_call` item per tool call; `status` is
"incomplete" (reason "max_output_tokens") when the output hit its token limit. `text.format`
(json_object or json_schema) is a structured output. `usage.input_tokens_details.cached_tokens`
counts the prompt tokens the prefix cache held.

Streamed (`stream: true`), the events are OpenAI's, each with its `sequence_number`:
response.created, response.in_progress, then per output item response.output_item.added, for a
message response.content_part.added / response.output_text.delta (as the text comes) /
response.output_text.done / response.content_part.done, for a function call
response.function_call_arguments.delta / .done, then response.output_item.done; last
response.completed or response.incomplete. An error after the stream began is an `error` event.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from jaxserve.entrypoints.openai.protocol.responses import (
    FunctionCallItem,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from jaxserve.entrypoints.openai.responses_input import (
    chat_tools,
    check_responses_unserved,
    to_messages,
    tool_use,
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
    off_loop,
    truncate,
)
from jaxserve.entrypoints.openai.serving_chat import apply_template
from jaxserve.entrypoints.openai.tool_calls import ToolCallStream, ToolUse


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


async def create_response(state: ServingState, req: ResponsesRequest):
    """The response object, or (stream=True) an async iterator of SSE strings."""
    state.check_model(req.model)
    check_unserved(req)
    check_responses_unserved(req)
    tools = chat_tools(req)
    use = tool_use(state, req, tools)
    try:
        text, ids = await off_loop(apply_template, state, to_messages(req), tools=tools)
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
    fields: dict[str, Any] = {}
    if use.constrains:
        fields["structured_outputs"] = {"json": use.schema}
    if use.mode == "auto":  # the parser reads the call markers, special tokens or not
        fields["skip_special_tokens"] = False
    sp = make_sampling_params(state, req, max_tokens=max_tokens, **fields)
    await check_request(state, req, ids, sp)
    shell = _shell(state, req, _id("resp"))
    if req.stream:
        return _events(_stream(state, text, ids, sp, shell, use))
    final = None
    async with deadline(state):
        async with contextlib.aclosing(
            generate_all(state, [(text, ids)], [sp], False, model=req.model)
        ) as outs:
            async for _, out in outs:
                final = out
    c = final.outputs[0]
    status = _status(c)
    content, calls = use.parse(c.text)
    items: list[OutputMessage | FunctionCallItem] = []
    if content or not calls:
        items.append(_message(_id("msg"), status, content or ""))
    items += [_function_call(_id("fc"), call, status) for call in calls]
    return _finished(shell, status, items, final)


def _status(c) -> str:
    return "incomplete" if c.finish_reason == "length" else "completed"


def _message(mid: str, status: str, text: str) -> OutputMessage:
    return OutputMessage(id=mid, status=status, content=[OutputText(text=text)])


def _function_call(fid: str, call: dict, status: str) -> FunctionCallItem:
    fn = call["function"]
    return FunctionCallItem(
        id=fid, call_id=call["id"], name=fn["name"], arguments=fn["arguments"], status=status
    )


def _shell(state: ServingState, req: ResponsesRequest, rid: str) -> ResponseObject:
    """The response as created: in progress, no output yet, echoing the request's settings."""
    fmt = req.text.format if req.text is not None and req.text.format is not None else None
    return ResponseObject(
        id=rid,
        status="in_progress",
        model=state.answer_name(req.model),
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        metadata=req.metadata,
        parallel_tool_calls=req.parallel_tool_calls,
        temperature=req.temperature,
        top_p=req.top_p,
        tool_choice=req.tool_choice,
        tools=req.tools or [],
        text={"format": fmt.model_dump(by_alias=True, exclude_none=True)}
        if fmt is not None
        else {"format": {"type": "text"}},
        user=req.user,
    )


def _finished(shell: ResponseObject, status: str, items: list, out) -> ResponseObject:
    n_in, n_out = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
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
            "output": items,
            "usage": usage,
        }
    )


class _Items:
    """The stream's output items as they open and close: a message (its text as it comes) and a
    function call per tool call (its arguments as they come), one open at a time."""

    def __init__(self):
        self.items: list[OutputMessage | FunctionCallItem] = []
        self.calls: dict[int, int] = {}  # tool-call index -> output index
        self.open: int | None = None  # the output index of the open item
        self.text = ""  # the message's text

    def _at(self, index: int) -> dict:
        return {"item_id": self.items[index].id, "output_index": index}

    def add(self, item) -> list[dict]:
        events = self.close("completed")  # the item before is whole
        self.items.append(item)
        self.open = len(self.items) - 1
        events.append({"type": "response.output_item.added", "output_index": self.open,
                       "item": item.model_dump()})  # fmt: skip
        if isinstance(item, OutputMessage):
            events.append({"type": "response.content_part.added", **self._at(self.open),
                           "content_index": 0, "part": OutputText(text="").model_dump()})  # fmt: skip
        return events

    def content(self, delta: str) -> list[dict]:
        events = []
        if self.open is None or not isinstance(self.items[self.open], OutputMessage):
            events += self.add(OutputMessage(id=_id("msg"), status="in_progress"))
        self.text += delta
        events.append({"type": "response.output_text.delta", **self._at(self.open),
                       "content_index": 0, "delta": delta, "logprobs": []})  # fmt: skip
        return events

    def call(self, d: dict) -> list[dict]:
        events = []
        fn = d.get("function") or {}
        if d["index"] not in self.calls:
            item = FunctionCallItem(id=_id("fc"), call_id=d["id"], name=fn.get("name") or "",
                                    arguments="", status="in_progress")  # fmt: skip
            events += self.add(item)
            self.calls[d["index"]] = self.open
        index = self.calls[d["index"]]
        if fn.get("arguments"):
            self.items[index].arguments += fn["arguments"]
            events.append({"type": "response.function_call_arguments.delta", **self._at(index),
                           "delta": fn["arguments"]})  # fmt: skip
        return events

    def close(self, status: str) -> list[dict]:
        """Ends the open item (its status, its done events)."""
        if self.open is None:
            return []
        index, self.open = self.open, None
        item = self.items[index]
        events = []
        if isinstance(item, OutputMessage):
            part = OutputText(text=self.text)
            item.content = [part]
            events += [
                {"type": "response.output_text.done", **self._at(index), "content_index": 0,
                 "text": self.text, "logprobs": []},
                {"type": "response.content_part.done", **self._at(index), "content_index": 0,
                 "part": part.model_dump()},
            ]  # fmt: skip
        else:
            events.append({"type": "response.function_call_arguments.done", **self._at(index),
                           "name": item.name, "arguments": item.arguments})  # fmt: skip
        item.status = status
        events.append({"type": "response.output_item.done", "output_index": index,
                       "item": item.model_dump()})  # fmt: skip
        return events


async def _stream(state, text, ids, sp, shell, use: ToolUse) -> AsyncIterator[dict]:
    """The stream's events (dicts with their "type"), in OpenAI's order."""
    yield {"type": "response.created", "response": shell.model_dump()}
    yield {"type": "response.in_progress", "response": shell.model_dump()}
    items, view, final = _Items(), ToolCallStream(use), None
    if use.mode == "none":  # a text reply: its message opens at once, as OpenAI's
        for event in items.add(OutputMessage(id=_id("msg"), status="in_progress")):
            yield event
    async with deadline(state):
        async with contextlib.aclosing(
            generate_all(state, [(text, ids)], [sp], True, model=shell.model)
        ) as outs:
            async for _, out in outs:
                c = out.outputs[0]
                delta, calls = view.update(c.text, c.finish_reason is not None)
                events = items.content(delta) if delta else []
                for d in calls:
                    events += items.call(d)
                for event in events:
                    yield event
                final = out
    status = _status(final.outputs[0])
    if not items.items:  # nothing came: an empty message
        for event in items.add(OutputMessage(id=_id("msg"), status="in_progress")):
            yield event
    for event in items.close(status):
        yield event
    done = _finished(shell, status, items.items, final)
    yield {"type": f"response.{status}", "response": done.model_dump()}


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
