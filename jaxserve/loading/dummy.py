"""The `dummy` load format: random weights at a named preset's real shapes (no files, no tokenizer).

    dummy_params(config, dtype, seed=0) -> params pytree, built on device by one jitted init

Performance can then be measured at e.g. llama3-8b or qwen2-7b shapes without their weights.
The init is jitted with the config static and the key as an argument, so it runs as one XLA
program that writes each weight straight in `dtype` (no f32 copy of an 8B model on the host).

This format allocates from the config alone, so it first refuses a config whose params would not
fit in memory (`memory_limit_bytes`: the device's limit where it reports one, else the host's
physical memory) with a ValueError naming the bytes needed, rather than dying in the allocator.
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp

from jaxserve.config import DTYPES, ModelConfig
from jaxserve.loading.params import flat_shapes
from jaxserve.models.llama import init_params


@functools.partial(jax.jit, static_argnames=("config", "dtype"))
def _init(key: jax.Array, config: ModelConfig, dtype: str) -> dict:
    return init_params(config, key, jnp.dtype(dtype))


def memory_limit_bytes() -> int:
    """The memory the params may take: the default device's limit (`jax.default_device` if set:
    the host while staging for a mesh), else physical host memory."""
    host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    device = jax.config.jax_default_device
    if not isinstance(device, jax.Device):
        device = jax.local_devices()[0]
    stats = device.memory_stats() or {}
    return min(host, int(stats.get("bytes_limit", host)))


def param_bytes(config: ModelConfig, dtype: str) -> int:
    """Bytes of the params of `config` in `dtype`, from the shapes alone (nothing allocated)."""
    return sum(math.prod(s) for s in flat_shapes(config).values()) * jnp.dtype(dtype).itemsize


def dummy_params(config: ModelConfig, dtype: str = "float32", seed: int = 0) -> dict:
    """Random normal(0, 0.02) weights, norms at 1, in `dtype` ('float32' | 'bfloat16')."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    need, limit = param_bytes(config, dtype), memory_limit_bytes()
    if need > limit:
        raise ValueError(
            f"dummy:{config.name or 'custom'} needs {need} bytes ({need / 2**30:.1f} GiB) of "
            f"params in {dtype}, which exceed the {limit} bytes of memory available"
        )
    return _init(jax.random.key(seed), config, dtype)
