"""The `dummy` load format: random weights at a named preset's real shapes (no files, no tokenizer).

    dummy_params(config, dtype, seed=0) -> params pytree, built on device one weight at a time

Performance can then be measured at e.g. llama3-8b or qwen2-7b shapes without their weights.
Each weight is one jitted program (compiled once per shape) that draws it in f32 and writes it
straight in `dtype`, so the peak memory is the params plus one weight's f32 draw. (One program
for the whole init, as before the seventeenth session, left 18.8 GB resident for the 3.2 GB of
3 Llama-3-8B layers on the CPU, and OOM-killed the family decode-step benchmark, JOURNAL.md 28.)

This format allocates from the config alone, so it first refuses a config whose params would not
fit in memory (`memory_limit_bytes`: the device's limit where it reports one, else the host's
physical memory) with a ValueError naming the bytes needed, rather than dying in the allocator.
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp

from jaxserve.config import DTYPES, ModelConfig
from jaxserve.loading.params import flat_shapes
from jaxserve.models.llama import init_params


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
    return init_params(config, jax.random.key(seed), jnp.dtype(dtype))
