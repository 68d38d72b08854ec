"""POST /v1/responses (OpenAI's Responses API): the request (the sampling fields, input items,
text.format, function tools), the output items and the response object. responses_input.py
turns the request into a chat completion's messages and tools; serving_responses.py serves it."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field

from jaxserve.entrypoints.openai.protocol.common import RequestModel, ResponseModel
from jaxserve.entrypoints.openai.protocol.sampling import SamplingRequest


class TextFormat(RequestModel):
    """The Responses API's text.format: text, any JSON object, or JSON following a schema (the
    schema and its name at the top, not under json_schema as in chat's response_format)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(RequestModel):
    format: TextFormat | None = None


class ResponsesRequest(SamplingRequest):
    """POST /v1/responses (OpenAI's Responses API, text in and out), with the sampling fields
    and vLLM's extras of the other endpoints. What it does not serve is a 400 naming the field
    (responses_input.check_responses_unserved), never ignored."""

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    store: bool = True  # nothing is stored here: every response says store=false
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool = False
    tools: list[dict[str, Any]] | None = None  # function tools: {"type", "name", "parameters"}
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    include: list[str] | None = None
    top_logprobs: int | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    reasoning: dict[str, Any] | None = None  # no reasoning models here: accepted, unused

    @property
    def structured_field(self) -> str:
        if self.text is not None and self.text.format is not None:
            return "text"
        return super().structured_field

    def structured_outputs_kwargs(self) -> dict[str, Any] | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return super().structured_outputs_kwargs()
        if self.structured_outputs is not None or self.response_format is not None:
            raise ValueError(
                "structured_outputs: give one of text.format, response_format or structured_outputs"
            )
        if fmt.type == "json_object":
            return {"json_object": True}
        if fmt.schema_ is None:
            raise ValueError("structured_outputs: text.format json_schema needs its schema")
        return {"json": fmt.schema_}


class OutputText(ResponseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = Field(default_factory=list)
    logprobs: list = Field(default_factory=list)


class OutputMessage(ResponseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallItem(ResponseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str  # JSON
    status: Literal["in_progress", "completed", "incomplete"]


class ResponseUsage(ResponseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]  # {"cached_tokens": prompt tokens the prefix cache held}
    output_tokens: int
    output_tokens_details: dict[str, int] = Field(default_factory=lambda: {"reasoning_tokens": 0})
    total_tokens: int


class ResponseObject(ResponseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete"]
    incomplete_details: dict[str, str] | None = None
    error: dict[str, Any] | None = None
    model: str
    output: list[OutputMessage | FunctionCallItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: str | dict[str, Any] = "auto"
    tools: list = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: str = "disabled"
    store: bool = False
    background: bool = False
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    user: str | None = None
