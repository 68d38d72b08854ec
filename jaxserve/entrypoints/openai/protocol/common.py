"""The pieces every endpoint's objects share: the request and response base models, errors,
usage, vLLM's prompt log-probs, and response ids.

Requests are parsed strictly (no "5" -> 5 coercion), so a wrong type is a 400 naming the field;
unknown fields are ignored, and a field sent as null takes its default, as OpenAI's API
and vLLM do (many clients send every field, unset ones as null). Ranges that only the engine knows (the
prompt against max_model_len, n against the slots) are checked in the serving code;
`SamplingParams` checks the rest and names the field it rejects.
"""

from __future__ import annotations

import uuid
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class RequestModel(BaseModel):
    """A request body: strict types, unknown fields ignored, null as the default."""

    model_config = ConfigDict(strict=True, extra="ignore")
    keeps_null: ClassVar[frozenset[str]] = frozenset()  # fields where null means something

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """`"n": null` means what leaving `n` out means (a required field stays required)."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k in cls.keeps_null}
        return data


class ResponseModel(BaseModel):
    """A response body (extra fields allowed)."""

    model_config = ConfigDict(extra="allow")


class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(ResponseModel):
    error: ErrorInfo


class Usage(ResponseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class PromptLogprob(ResponseModel):
    """vLLM's `Logprob` as its server sends it in `prompt_logprobs`."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: per prompt token (the first None), token id (a JSON key) -> log-prob
PromptLogprobs = list[dict[str, PromptLogprob] | None]
