"""What the runner holds on the device, laid out and allocated once when it is built; the GPU
program inspector (`bench/gpu_programs.py`) builds the same pool and slot state abstractly.

    check_built(engine_config, mesh)
        what a blueprint is made from is finished (`runner.blueprint.blueprint` asks): the
        config filled for the model, the mesh of its parallel sizes (`build_engine` makes both)
    kernel_layout(params, blueprint) -> params
        the KV heads' columns copied up to T, the quantized weights' matmul impl, the CPU
        kernels' [out, in] layout or the GPU's fused q/k/v and gate/up stacks (a pure transform:
        the inspector runs it abstractly)
    layout_params(params, blueprint) -> params
        kernel_layout, then each device's shards
    state_fns(blueprint) -> (init_cache, init_state)
        the KV pool and the slot state, as functions (to allocate, or to `jax.eval_shape`)
    state_specs(cache, state, data_shards) -> (cache specs, state specs)
        how they split over the mesh: the pool by pages over 'data', the slots per data shard
    allocate(init_cache, init_state, mesh, data_shards) -> (cache, state)
        each device allocates only its share
    on_device(tree, mesh)
        host arrays onto the device, replicated over the mesh (a step's inputs two programs read)
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.config import EngineConfig
from jaxserve.layers import linear
from jaxserve.parallel import partition
from jaxserve.parallel.mesh import mesh_sizes
from jaxserve.quant import with_matmul_impl
from jaxserve.runner import data_parallel, slot_state, steps


def check_built(engine_config: EngineConfig, mesh) -> None:
    """ValueError unless `engine_config` is filled for the model and `mesh` (None for one
    device) has its parallel sizes: the runner derives neither (`engine_args.build_engine`
    makes both)."""
    if not engine_config.is_filled:
        raise ValueError(
            "the runner needs an EngineConfig filled for the model: "
            "engine_config.for_model(model_config) (engine_args.build_engine does it)"
        )
    t, d = engine_config.parallel.tensor_parallel_size, engine_config.parallel.data_parallel_size
    if mesh is None and t * d > 1:
        raise ValueError(
            f"tensor_parallel_size={t} x data_parallel_size={d} needs a mesh of {t * d} "
            "devices: jaxserve.parallel.mesh.make_mesh(t, d) (engine_args.build_engine makes it)"
        )
    if mesh is not None and mesh_sizes(mesh) != (d, t):
        raise ValueError(
            f"the mesh's (data, model) sizes {mesh_sizes(mesh)} are not the config's {(d, t)}"
        )


def kernel_layout(params, blueprint):
    """`params` as the blueprint's kernels read them (`runner.blueprint.Blueprint`): the KV heads'
    columns copied up to T, the quantized weights' matmul impl, then the weight layout
    (`Resolved.weight_layout`): the C++ CPU kernels' [out, in], or on GPU each group of plain
    weights sharing an input as one stack (`linear.fuse_projections`). A pure transform of the
    arrays (the GPU inspector runs it under `jax.eval_shape`)."""
    r = blueprint.resolved
    params = partition.take_kv_columns(params, blueprint.kv_columns)
    params = with_matmul_impl(params, r.quant_matmul, r.quant_kernel_rows)
    if r.weight_layout == "fused":  # GPU: q/k/v and gate/up each one GEMM
        layers = linear.fuse_projections(params["layers"], blueprint.model_config.num_layers)
        params = {**params, "layers": layers}
    if r.weight_layout == "out_in":
        kernel = r.model.cpu_matmul
        params = {**params, "layers": linear.cpu_layout(params["layers"], kernel)}
        head = params.get("lm_head")
        if kernel and isinstance(head, jax.Array):  # untied logits: the C++ matmul too
            params = {**params, "lm_head": linear.transposed(head, kernel)}
    return params


def layout_params(params, blueprint):
    """The loaded params as the blueprint's kernels read them (`kernel_layout`), on their shards
    of `blueprint.mesh` (None: one device)."""
    params = kernel_layout(params, blueprint)
    if blueprint.mesh is not None:
        params = partition.shard_params(params, blueprint.model_config, blueprint.mesh)
    return params


def state_fns(blueprint):
    """(init_cache, init_state): the paged KV pool of `blueprint.num_pages` and the slot state of
    every slot (its page table `resolved.max_pages` wide; the n-gram proposer's token history
    only when speculating, `spec_decode.py`)."""
    e, c, r = blueprint.engine_config, blueprint.model_config, blueprint.resolved
    cache, sched = e.cache, e.scheduler
    history_len = sched.max_model_len if e.speculative.num_speculative_tokens else 0

    def init_cache():
        return steps.init_cache(
            c, blueprint.num_pages, cache.page_size, cache.kv_cache_dtype, e.load.dtype
        )

    def init_state():
        return slot_state.init_slot_state(sched.num_slots, r.max_pages, c.vocab_size, history_len)

    return init_cache, init_state


def state_specs(cache, state, data_shards: int):
    """The PartitionSpecs of the pool and the slot state (arrays or their shapes)."""
    cache_specs = partition.cache_specs(cache, data_axis=data_shards > 1)
    if data_shards > 1:
        return cache_specs, data_parallel.state_specs(state)
    return cache_specs, partition.replicated(state)


def allocate(init_cache, init_state, mesh, data_shards: int):
    """(cache, state) on the device, or each device's share of them on a mesh."""
    if mesh is None:
        return init_cache(), init_state()
    cache_specs, slot_specs = state_specs(
        jax.eval_shape(init_cache), jax.eval_shape(init_state), data_shards
    )
    cache = jax.jit(init_cache, out_shardings=partition.named(mesh, cache_specs))()
    state = jax.jit(init_state, out_shardings=partition.named(mesh, slot_specs))()
    return cache, state


def on_device(tree, mesh):
    """Host arrays onto the device (replicated over `mesh`, None: one device)."""
    if mesh is None:
        return jax.device_put(tree)
    return jax.tree.map(lambda x: partition.place(x, NamedSharding(mesh, P())), tree)
