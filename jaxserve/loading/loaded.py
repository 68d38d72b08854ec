"""What `load_model` returns, and the names of the default model: a leaf that every loader imports.

LoadedModel(config, params, tokenizer, source)
ModelLoadError(ValueError)   a model file that cannot be loaded, its message naming the file
read_json(path, what)        a JSON file's value, or ModelLoadError naming it
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from jaxserve.config import ModelConfig

# `load_model(None)` and these names load the default SmolLM2 GGUF (`default_model.py`).
DEFAULT_MODEL_NAMES = ("smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct")


class ModelLoadError(ValueError):
    """A model file is malformed, inconsistent or outside the model directory.

    The message starts with the file's path and says what is wrong with it; `path` holds it.
    """

    def __init__(self, path, problem: str):
        self.path = str(path)
        super().__init__(f"{path}: {problem}")


def read_json(path, what: str):
    """The value of a JSON file; ModelLoadError naming it when it cannot be read or parsed."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ModelLoadError(path, f"{what} is not valid JSON: {e}") from e
    except OSError as e:
        raise ModelLoadError(path, f"cannot read {what}: {e}") from e


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig
    params: dict  # the params pytree of models/llama.py (jax arrays or quantized-weight pytrees)
    tokenizer: PreTrainedTokenizerBase | None  # None: token-id prompts only
    source: str  # what was loaded: a path, "dummy:<preset or config name>"
