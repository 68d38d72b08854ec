"""OpenAI's request and response objects (pydantic), plus vLLM's sampling extras.

Requests are parsed strictly (no "5" -> 5 coercion), so a wrong type is a 400 naming the field;
unknown fields are ignored, and a field sent as null takes its default, as OpenAI's API
and vLLM do (many clients send every field, unset ones as null). Ranges that only the engine knows (the
prompt against max_model_len, n against the slots) are checked in the serving code;
`SamplingParams` checks the rest and names the field it rejects.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    keeps_null: ClassVar[frozenset[str]] = frozenset()  # fields where null means something

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """`"n": null` means what leaving `n` out means (a required field stays required)."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k in cls.keeps_null}
        return data


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


# -- errors -----------------------------------------------------------------------------------------
class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(_Response):
    error: ErrorInfo


# -- requests -------------------------------------------------------------------------------------
class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """OpenAI's response_format: text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingRequest(_Request):
    """Fields shared by completions and chat completions (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = None
    n: int = Field(default=1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (a JSON key) -> bias
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's: json / regex / choice / grammar
    prompt_logprobs: int | None = Field(default=None, ge=-1)  # vLLM's: top-n per prompt token
    priority: int = 0  # vLLM's: lower runs first with --scheduling_policy=priority
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)  # vLLM's: keep the last k
    use_beam_search: bool = False  # vLLM's; not served here (a 400, never ignored)

    @property
    def structured_field(self) -> str:
        """The field a structured-output error names: the one this request used."""
        return "structured_outputs" if self.structured_outputs is not None else "response_format"

    def structured_outputs_kwargs(self) -> dict[str, Any] | None:
        """SamplingParams.structured_outputs from `structured_outputs` or `response_format` (as
        vLLM's server: json_object -> any JSON object, json_schema -> its schema)."""
        fmt = self.response_format
        if fmt is not None and fmt.type != "text" and self.structured_outputs is not None:
            raise ValueError(
                "structured_outputs: give either response_format or structured_outputs, not both"
            )
        if self.structured_outputs is not None:
            return dict(self.structured_outputs)
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"json_object": True}
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise ValueError(
                "structured_outputs: response_format json_schema needs json_schema.schema"
            )
        return {"json": fmt.json_schema.schema_}

    def sampling_kwargs(self) -> dict[str, Any]:
        """The SamplingParams fields this request sets (max_tokens and log-probs excepted)."""
        kw: dict[str, Any] = {
            "n": self.n,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "min_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens,
        }
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed"):
            if getattr(self, name) is not None:
                kw[name] = getattr(self, name)
        if self.stop:
            kw["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if self.stop_token_ids:
            kw["stop_token_ids"] = list(self.stop_token_ids)
        if self.logit_bias:
            # OpenAI's and vLLM's server: each bias clamped to [-100, 100] (a bad key is a 400)
            kw["logit_bias"] = {k: min(100.0, max(-100.0, v)) for k, v in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            kw["allowed_token_ids"] = list(self.allowed_token_ids)
        if self.bad_words:
            kw["bad_words"] = list(self.bad_words)
        structured = self.structured_outputs_kwargs()
        if structured is not None:
            kw["structured_outputs"] = structured
        return kw


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0)  # at most the engine's max_logprobs
    echo: bool = False
    suffix: str | None = None  # fill-in-the-middle: no model here renders it (a 400, as vLLM)
    add_special_tokens: bool = True  # vLLM's: for text prompts


class ChatMessage(_Request):
    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingRequest):
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


class TextFormat(_Request):
    """The Responses API's text.format: text, any JSON object, or JSON following a schema (the
    schema and its name at the top, not under json_schema as in chat's response_format)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Request):
    format: TextFormat | None = None


class ResponsesRequest(_SamplingRequest):
    """POST /v1/responses (OpenAI's Responses API, text in and out), with the sampling fields
    and vLLM's extras of the other endpoints. What it does not serve is a 400 naming the field
    (serving_responses.check_responses_unserved), never ignored."""

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


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class LoadLoRAAdapterRequest(_Request):
    """vLLM's /v1/load_lora_adapter body."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False  # replace an adapter already loaded under this name


class UnloadLoRAAdapterRequest(_Request):
    """vLLM's /v1/unload_lora_adapter body."""

    lora_name: str
    lora_int_id: int | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# -- responses ------------------------------------------------------------------------------------
class Usage(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(_Response):
    """vLLM's `Logprob` as its server sends it in `prompt_logprobs`."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: per prompt token (the first None), token id (a JSON key) -> log-prob
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # jaxserve extra (vLLM's return_token_ids)
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, whenever they were computed


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(_Response):
    name: str
    arguments: str  # JSON


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class _Delta(_Response):
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


class ChatMessageOut(_Response):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(_Response):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's


class DeltaMessage(_Response):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "jaxserve"
    max_model_len: int | None = None
    root: str | None = None  # a LoRA adapter's folder (vLLM's)
    parent: str | None = None  # a LoRA adapter's base model (vLLM's)


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- the Responses API ----------------------------------------------------------------------------
class OutputText(_Response):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = Field(default_factory=list)
    logprobs: list = Field(default_factory=list)


class OutputMessage(_Response):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallItem(_Response):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str  # JSON
    status: Literal["in_progress", "completed", "incomplete"]


class ResponseUsage(_Response):
    input_tokens: int
    input_tokens_details: dict[str, int]  # {"cached_tokens": prompt tokens the prefix cache held}
    output_tokens: int
    output_tokens_details: dict[str, int] = Field(default_factory=lambda: {"reasoning_tokens": 0})
    total_tokens: int


class ResponseObject(_Response):
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
