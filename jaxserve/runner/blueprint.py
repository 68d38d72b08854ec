"""`Blueprint`: what a `ModelRunner` is built from, decided before any array is laid out or
allocated. One derivation for the engine and for the GPU program inspector, so the programs the
inspector compiles are the engine's:

    engine_args.build_engine           blueprint(params, model_config, engine_config, mesh=mesh)
                                       -> ModelRunner(params, blueprint)
    bench/gpu_programs.abstract_engine blueprint(abstract params, ..., backend="gpu",
                                       mesh=a compile-only mesh, device_kind=the chip's,
                                       memory_bytes=the chip's) -> the runner's layout, pool and
                                       slot state, from jax.eval_shape

blueprint(...) checks that what it is given is finished (the config filled for the model, the
mesh of its parallel sizes: `device_state.check_built`), then decides, in order:

    KV heads       copied up to T where T exceeds them: the runner's model config has T KV heads,
                   its wk / wv columns are `kv_columns` (`partition.kv_columns`)
    choices        `resolve` on `backend` for one data shard (`resolve.data_shard_config`), with
                   what this process offers: the C++ CPU kernels (`cpu_backend`), the GPU's
                   autotuning cache (`compile_cache.autotune_dir`), the chip's kernel table row;
                   on GPU the fused q/k/v and gate/up stacks only where the largest fits beside
                   the weights (`fused_if_it_fits`)
    the pool       the pages the config asks for (`memory.requested_pages`, of the pool's own
                   KV heads, replicas included), lowered where the Pallas kernels need it, and
                   one device's share checked against its memory (`memory.pool_pages`)
"""

from __future__ import annotations

import dataclasses
import logging
import math

import jax
import numpy as np

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.layers import linear
from jaxserve.layers.embedding import is_quantized
from jaxserve.parallel import partition
from jaxserve.resolve import Resolved, data_shard_config, resolve
from jaxserve.runner import compile_cache, cpu_backend, device_state, memory

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, eq=False)
class Blueprint:
    """A runner's finished inputs (see the module docstring); `blueprint` makes one."""

    engine_config: EngineConfig  # filled for the model; the whole engine's (every data shard)
    model_config: ModelConfig  # KV heads replicated up to T where T exceeds them
    kv_columns: np.ndarray | None  # the wk / wv columns the replicated heads copy; None: none
    resolved: Resolved  # one data shard's choices on the backend
    num_pages: int  # the KV pool's pages, every data shard's
    mesh: object | None  # a ('data', 'model') mesh of the parallel sizes; None: one device

    @property
    def data_shards(self) -> int:
        return self.engine_config.parallel.data_parallel_size


def blueprint(
    params,
    model_config: ModelConfig,
    engine_config: EngineConfig,
    num_pages: int | None = None,
    *,
    backend: str | None = None,
    mesh=None,
    device_kind: str | None = None,
    memory_bytes: int | None = None,
) -> Blueprint:
    """The blueprint of a runner of `params` (arrays, or their `jax.eval_shape`: only whether a
    layer weight is quantized is read) for the checkpoint's `model_config`, with `engine_config`
    filled for it.

    num_pages: the pool's pages before the kernels' limits (None: `memory.requested_pages`).
    backend: whose choices to make (None: the one jax runs on; a test lowering a GPU engine's
    steps on the CPU passes "gpu"). device_kind: the GPU's (None: this process's first device,
    on GPU). memory_bytes: what one device's share of the pool and slot state must fit in
    (None: this process's first device, `memory.device_memory_bytes`). ValueError naming what
    is not finished or does not fit."""
    device_state.check_built(engine_config, mesh)
    e = engine_config
    backend = backend or jax.default_backend()
    gpu = backend == "gpu"
    if gpu and device_kind is None:
        device_kind = jax.devices()[0].device_kind
    t = e.parallel.tensor_parallel_size
    config = partition.replicated_config(model_config, t)
    resolved = resolve(
        data_shard_config(e),  # the step shapes are one data shard's
        config,
        backend,
        cpu_kernel=cpu_backend.attention_kernel(backend, e.kernels),
        cpu_matmul=cpu_backend.matmul_kernel(backend, e.kernels, mesh),
        plain_weights=not any(map(is_quantized, params["layers"].values())),
        autotune_cache_dir=compile_cache.autotune_dir(e.compilation.compilation_cache)
        if gpu
        else None,
        device_kind=device_kind if gpu else None,
    )
    if resolved.weight_layout == "fused":  # the layout writes a fused stack beside the weights
        resolved = fused_if_it_fits(resolved, params, config, memory_bytes)
    if num_pages is None:  # the pool's own KV heads: kv_cache_memory is what it allocates
        num_pages = memory.requested_pages(e, config)
    num_pages = memory.pool_pages(
        num_pages,
        config,
        e,
        resolved.model.attention,
        memory_bytes,
        shared_memory=backend == "cpu",  # a CPU's devices share the host's RAM
    )
    return Blueprint(
        engine_config=e,
        model_config=config,
        kv_columns=partition.kv_columns(model_config, t),
        resolved=resolved,
        num_pages=num_pages,
        mesh=mesh,
    )


def fused_if_it_fits(resolved: Resolved, params, model_config: ModelConfig, memory_bytes=None):
    """`resolved`, or with the weights as loaded ('in_out') where fusing them would not fit: the
    GPU layout concatenates q/k/v and gate/up (`linear.fuse_projections`) while the separate
    stacks still live, so one device holds the weights and the largest fused stack at once
    (Llama-3-8B bf16: 16 + 7.5 GB; Gemma-2-27B would not fit an H100's 80 GB)."""
    have = memory.device_memory_bytes() if memory_bytes is None else memory_bytes
    weights = sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(params))
    extra = linear.fusion_bytes(params["layers"], model_config.num_layers)
    if weights + extra <= have:
        return resolved
    logger.info(
        "weights kept as loaded: fusing q/k/v and gate/up needs %.1f GiB beside %.1f GiB of "
        "weights, more than the device's %.1f GiB",
        extra / 2**30,
        weights / 2**30,
        have / 2**30,
    )
    return dataclasses.replace(resolved, weight_layout="in_out")
