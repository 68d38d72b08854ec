"""vLLM's /tokenize (a prompt or chat messages) and /detokenize request bodies."""

from __future__ import annotations

from jaxserve.entrypoints.openai.protocol.chat import ChatMessage
from jaxserve.entrypoints.openai.protocol.common import RequestModel


class TokenizeRequest(RequestModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]
