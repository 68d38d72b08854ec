"""POST /v1/chat/completions: the request (the sampling fields, messages, tools, the chat
template's settings), the response's choices with their tool calls and log-probs, and the
streamed chunks with their deltas."""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field, model_serializer

from jaxserve.entrypoints.openai.protocol.common import (
    PromptLogprobs,
    RequestModel,
    ResponseModel,
    Usage,
)
from jaxserve.entrypoints.openai.protocol.sampling import SamplingRequest


class ChatMessage(RequestModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)  # at most the engine's max_logprobs
    max_completion_tokens: int | None = Field(default=None, ge=0)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None  # given to the chat template as sent
    # tool_calls.ToolUse: absent -> "auto" with tools, else "none"; an explicit null -> "none"
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # vLLM's: needs --trust_request_chat_template
    documents: list[dict[str, Any]] | None = None  # vLLM's: given to the template
    echo: bool = False  # vLLM's: the final assistant message's text before the reply
    keeps_null: ClassVar[frozenset[str]] = frozenset({"tool_choice"})

    @property
    def tool_choice_given(self) -> str | dict[str, Any] | None:
        """tool_choice as `ToolUse.of` takes it: None where the request left it out."""
        if "tool_choice" not in self.model_fields_set:
            return None
        return "none" if self.tool_choice is None else self.tool_choice

    @property
    def structured_field(self) -> str:
        if isinstance(self.tool_choice, dict) or self.tool_choice == "required":
            return "tools"  # the grammar of the tools' schemas
        return super().structured_field


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(ResponseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(ResponseModel):
    name: str
    arguments: str  # JSON


class ToolCall(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class _Delta(ResponseModel):
    """A streamed fragment: its unset fields are left out, not sent as null (the openai
    client's stream helper merges fragments, and a null `type` would overwrite "function")."""

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_Delta):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Delta):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatMessageOut(ResponseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(ResponseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's


class DeltaMessage(ResponseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
