"""Device memory: the budget checked before allocation, and the plan of what each device holds.

    state_bytes(model_config, engine_config, num_pages)   KV pool and slot state bytes (totals)
    device_memory_bytes()                                  the first local device's memory
    requested_pages(engine_config, model_config)           the pages the config asks for
    pool_pages(num_pages, model_config, engine_config, attention, memory_bytes, shared_memory)
                                                           the pool's pages: for the Pallas
                                                           kernels, and checked (below)
    per_device(state_bytes, engine_config)                 one device's share of them
    pallas_pool_pages(num_pages, model_config, engine_config)   pages the Pallas kernels read right
    check_memory(...)                                      ValueError before an allocation fails:
                                                           one device's share against its memory
                                                           (every share against a CPU's RAM)
    bytes_on_device(tree, device)                          bytes of `tree`'s shards on `device`
    memory_plan(runner) -> dict                            per device: params, KV pool, slot
                                                           state, workspace; pages per data shard
    workspace_bytes(runner, decode, prefill)               XLA temp bytes of the largest programs

The plan is measured from the placed arrays themselves (their addressable shards), so the figures
are what the partition rules did, not what they meant to do; it is logged at start-up and after
warm-up, and returned by `LLM.stats()["memory"]`. The workspace is XLA's temporary buffer of the
largest compiled decode and prefill programs (`memory_analysis()` of the warm-up's executables),
None until warm-up has compiled them.
"""

from __future__ import annotations

import logging
import os

import jax

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.layers import kv_cache

logger = logging.getLogger(__name__)


def state_bytes(model_config: ModelConfig, engine_config: EngineConfig, num_pages: int) -> dict:
    """Device bytes of the KV pool and of the slot state (S slots, V vocab): the sampling state
    holds i32 token counts and three bool masks per slot and vocabulary entry, and the fixed-size
    logit_bias / bad_words arrays (about 2.6 KB)."""
    c, cache = model_config, engine_config.cache
    per_token = kv_cache.bytes_per_token(
        c.num_layers, c.num_kv_heads, c.head_dim, cache.kv_cache_dtype, engine_config.load.dtype
    )
    per_slot = 7 * c.vocab_size + 4 * engine_config.max_pages_per_seq + 2688
    slots = engine_config.scheduler.num_slots * per_slot
    return {"kv_pool": num_pages * cache.page_size * per_token, "slot_state": slots}


def device_memory_bytes() -> int:
    """Memory of the first local device: the allocator's limit on a GPU, physical RAM on the CPU."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def requested_pages(engine_config: EngineConfig, model_config: ModelConfig) -> int:
    """The pages the config asks for: num_pages, else kv_cache_memory // page bytes (a multiple
    of data_parallel_size), else enough for every slot at max_model_len. ValueError for a
    kv_cache_memory that holds no page. `pool_pages` then lowers it where the kernels need it."""
    cache = engine_config.cache
    if cache.num_pages is not None:
        return cache.num_pages
    if cache.kv_cache_memory is not None:
        c = model_config
        per_token = kv_cache.bytes_per_token(
            c.num_layers, c.num_kv_heads, c.head_dim, cache.kv_cache_dtype, engine_config.load.dtype
        )
        pages = cache.kv_cache_memory // (per_token * cache.page_size)
        pages -= pages % engine_config.parallel.data_parallel_size  # an equal share per shard
        if pages < 1:
            raise ValueError(
                f"kv_cache_memory={cache.kv_cache_memory} bytes holds no page "
                f"({per_token * cache.page_size} bytes per page)"
            )
        return int(pages)
    return engine_config.scheduler.num_slots * engine_config.max_pages_per_seq


def pallas_pool_pages(num_pages: int, model_config: ModelConfig, engine_config: EngineConfig):
    """num_pages, lowered (with a warning) where one device's int8 / fp8 pool array would hold
    2^31 elements or more but under 4 GiB, which the Pallas Triton kernels misread
    (`kv_cache.triton_safe_num_pages`). The pool stays within the bytes it was given."""
    c, cache, parallel = model_config, engine_config.cache, engine_config.parallel
    itemsize = kv_cache.storage_dtype(cache.kv_cache_dtype, engine_config.load.dtype).itemsize
    # one device's KV heads: the runner's config has them replicated up to T where T exceeds them
    heads = max(1, c.num_kv_heads // parallel.tensor_parallel_size)
    per_page = c.num_layers * heads * cache.page_size * c.head_dim
    safe = kv_cache.triton_safe_num_pages(
        num_pages, per_page, itemsize, parallel.data_parallel_size
    )
    if safe != num_pages:
        logger.warning(
            "KV pool lowered from %d to %d pages: an %s pool array of 2^31 or more elements "
            "under 4 GiB is misread by the Pallas Triton kernels (32-bit offsets; "
            "experiments/JOURNAL.md 48). A pool of 4 GiB or more per array is read right.",
            num_pages,
            safe,
            cache.kv_cache_dtype,
        )
    return safe


def pool_pages(
    num_pages: int,
    model_config,
    engine_config,
    attention: str,
    memory_bytes: int | None = None,
    shared_memory: bool = False,
) -> int:
    """The KV pool's pages: `num_pages`, lowered where the Pallas kernels would misread the pool
    (`pallas_pool_pages`; 'pallas' and 'mgpu' attention both run the Pallas prefill kernel), and
    checked against the device's memory (`check_memory`) before anything is allocated."""
    if attention in ("pallas", "mgpu"):
        num_pages = pallas_pool_pages(num_pages, model_config, engine_config)
    check_memory(model_config, engine_config, num_pages, memory_bytes, shared_memory)
    return num_pages


def per_device(need: dict, engine_config: EngineConfig) -> dict:
    """One device's share of `state_bytes`: the pool is split over the KV heads ('model', the
    heads replicated up to T where T exceeds them) and its pages over 'data'; the slot state is
    split over 'data' and replicated over 'model' (`device_state.state_specs`)."""
    t = engine_config.parallel.tensor_parallel_size
    d = engine_config.parallel.data_parallel_size
    return {"kv_pool": -(-need["kv_pool"] // (t * d)), "slot_state": -(-need["slot_state"] // d)}


def check_memory(
    model_config: ModelConfig,
    engine_config: EngineConfig,
    num_pages: int,
    memory_bytes: int | None = None,
    shared_memory: bool = False,
) -> None:
    """ValueError naming num_slots / num_pages when one device's share of the pool and slot state
    (`per_device`) cannot fit in `memory_bytes` (None: this process's first device,
    `device_memory_bytes`), instead of an opaque allocation failure inside XLA. shared_memory:
    the devices share one memory (a CPU's host RAM), which must then hold every device's share."""
    need = state_bytes(model_config, engine_config, num_pages)
    if not shared_memory:
        need = per_device(need, engine_config)
    have = device_memory_bytes() if memory_bytes is None else memory_bytes
    if sum(need.values()) > have:
        gib = lambda b: f"{b / 2**30:.1f} GiB"  # noqa: E731
        where = "in all" if shared_memory else "per device"
        raise ValueError(
            f"num_slots={engine_config.scheduler.num_slots} and num_pages={num_pages} need "
            f"{gib(need['kv_pool'])} of KV pages and {gib(need['slot_state'])} of slot state "
            f"{where}, more than the device's {gib(have)}: lower num_slots, num_pages or "
            "kv_cache_memory"
        )


def bytes_on_device(tree, device) -> int:
    total = 0
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            total += sum(s.data.nbytes for s in leaf.addressable_shards if s.device == device)
    return total


def memory_plan(runner) -> dict:
    """Per-device bytes (of the first local device; every device of a mesh holds the same share)
    and the KV pages each data shard owns."""
    dev = jax.local_devices()[0]
    stats = dev.memory_stats() or {}
    return {
        "devices": 1 if runner.mesh is None else runner.mesh.devices.size,
        "tensor_parallel_size": runner.config.parallel.tensor_parallel_size,
        "data_parallel_size": runner.config.parallel.data_parallel_size,
        "params_bytes_per_device": bytes_on_device(runner.params, dev),
        "kv_pool_bytes_per_device": bytes_on_device(runner.cache, dev),
        "slot_state_bytes_per_device": bytes_on_device(runner.state, dev),
        "workspace_bytes_per_device": runner.workspace_bytes,
        "kv_pages_per_data_shard": runner.cache.num_pages // runner.shards.count,
        "device_memory_bytes": stats.get("bytes_limit"),
    }


def describe(plan: dict) -> str:
    """One log line of the plan."""

    def gib(b):
        if b is None:
            return "? (after warm-up)"
        return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.2f} MiB"

    return (
        f"memory per device ({plan['devices']} devices, TP {plan['tensor_parallel_size']} x DP "
        f"{plan['data_parallel_size']}): params {gib(plan['params_bytes_per_device'])}, KV pool "
        f"{gib(plan['kv_pool_bytes_per_device'])} ({plan['kv_pages_per_data_shard']} pages per "
        f"data shard), slot state {gib(plan['slot_state_bytes_per_device'])}, workspace "
        f"{gib(plan['workspace_bytes_per_device'])}"
    )


def workspace_bytes(runner, decode, prefill) -> int | None:
    """XLA's temporary bytes per device of the largest decode and prefill programs (their
    executables are cached by the warm-up: lowering them again compiles nothing)."""
    arrays = runner.params, runner.cache, runner.state
    programs = [
        runner.structured.lower(*arrays, decode),
        runner.prefill_strategy.lower(*arrays, runner.shards.padding_batch(prefill), prefill),
    ]
    sizes = []
    for lowered in programs:
        analysis = lowered.compile().memory_analysis()
        if analysis is None:
            return None
        sizes.append(int(analysis.temp_size_in_bytes))
    return max(sizes)
