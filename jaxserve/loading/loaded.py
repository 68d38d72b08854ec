"""What `load_model` returns, and the names of the default model: a leaf that every loader imports.

LoadedModel(config, params, tokenizer, source)
"""

from __future__ import annotations

import dataclasses

from transformers import PreTrainedTokenizerBase

from jaxserve.config import ModelConfig

# `load_model(None)` and these names load the default SmolLM2 GGUF (`default_model.py`).
DEFAULT_MODEL_NAMES = ("smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct")


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig
    params: dict  # the params pytree of models/llama.py (jax arrays or quantized-weight pytrees)
    tokenizer: PreTrainedTokenizerBase | None  # None: token-id prompts only
    source: str  # what was loaded: a path, "dummy:<preset or config name>"
