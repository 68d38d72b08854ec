"""The `dummy` load format: random weights at a named preset's real shapes (no files, no tokenizer).

    dummy_params(config, dtype, seed=0) -> params pytree, built on device by one jitted init

Performance can then be measured at e.g. llama3-8b or qwen2-7b shapes without their weights.
The init is jitted with the config static and the key as an argument, so it runs as one XLA
program that writes each weight straight in `dtype` (no f32 copy of an 8B model on the host).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxserve.config import DTYPES, ModelConfig
from jaxserve.models.llama import init_params


@functools.partial(jax.jit, static_argnames=("config", "dtype"))
def _init(key: jax.Array, config: ModelConfig, dtype: str) -> dict:
    return init_params(config, key, jnp.dtype(dtype))


def dummy_params(config: ModelConfig, dtype: str = "float32", seed: int = 0) -> dict:
    """Random normal(0, 0.02) weights, norms at 1, in `dtype` ('float32' | 'bfloat16')."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    return _init(jax.random.key(seed), config, dtype)
