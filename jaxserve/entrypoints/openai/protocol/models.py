"""GET /v1/models (the base model and its LoRA adapters) and vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter bodies."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import Field

from jaxserve.entrypoints.openai.protocol.common import RequestModel, ResponseModel


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "jaxserve"
    max_model_len: int | None = None
    root: str | None = None  # a LoRA adapter's folder (vLLM's)
    parent: str | None = None  # a LoRA adapter's base model (vLLM's)


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadLoRAAdapterRequest(RequestModel):
    """vLLM's /v1/load_lora_adapter body."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False  # replace an adapter already loaded under this name


class UnloadLoRAAdapterRequest(RequestModel):
    """vLLM's /v1/unload_lora_adapter body."""

    lora_name: str
    lora_int_id: int | None = None
