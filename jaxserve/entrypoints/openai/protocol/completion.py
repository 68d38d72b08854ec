"""POST /v1/completions: the request (the sampling fields, a prompt, log-probs, echo) and the
response's choices."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import Field

from jaxserve.entrypoints.openai.protocol.common import PromptLogprobs, ResponseModel, Usage
from jaxserve.entrypoints.openai.protocol.sampling import SamplingRequest


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0)  # at most the engine's max_logprobs
    echo: bool = False
    suffix: str | None = None  # fill-in-the-middle: no model here renders it (a 400, as vLLM)
    add_special_tokens: bool = True  # vLLM's: for text prompts


class CompletionLogprobs(ResponseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # jaxserve extra (vLLM's return_token_ids)
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, whenever they were computed


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
