"""The sampling fields that completions, chat completions and responses share (OpenAI's, then
vLLM's extras), and the SamplingParams keyword arguments they make."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from jaxserve.entrypoints.openai.protocol.common import RequestModel


class StreamOptions(RequestModel):
    include_usage: bool = False


class JsonSchemaFormat(RequestModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    """OpenAI's response_format: text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingRequest(RequestModel):
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
