"""`ModelRunner`: the one device-facing object. It owns the params, the paged KV cache and the slot
state, and runs scheduler plans through the jitted steps of `steps.py`.

    dispatch(plan)   queues one engine step, in this order: release / move / insert / page-table
                     sync (host mirrors, one `sync` transfer), then `generate` (the slots that
                     were decoding before this step), then `prefill`; returns a handle
    fetch(handle)    ONE device->host transfer of the step's new tokens (and log-probs when a
                     request asked) -> StepResult

JAX dispatch is asynchronous, so the engine can dispatch the next step before fetching this one.
Each step runs in the smallest compiled shape that holds it (`jaxserve.resolve`: decode row, width
and flat-page buckets; prefill row and width buckets); `warmup()` compiles every shape
`Resolved.decode_shapes()` / `prefill_shapes()` lists, after which nothing recompiles
(tests/runner/test_runner.py). Every host->device and device->host transfer is counted.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import jax
import numpy as np

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.core.request import Request
from jaxserve.core.runner_api import StepResult
from jaxserve.core.sampling_params import SamplingParams, make_slot_row
from jaxserve.core.scheduler import SchedulerOutput
from jaxserve.layers import kv_cache, linear
from jaxserve.quant import with_matmul_impl
from jaxserve.resolve import DecodeShape, PrefillShape, Resolved, resolve
from jaxserve.runner import input_batch, steps


@dataclasses.dataclass
class StepHandle:
    """A dispatched step's device outputs, not yet on the host."""

    decode: steps.DecodeOutput | None = None
    decode_top: bool = False  # some decoding request asked for top log-probs
    prefill: steps.PrefillOutput | None = None
    prefill_top: bool = False

    def arrays(self) -> dict[str, jax.Array]:
        """The arrays to bring back, under StepResult's field names."""
        out = {}
        if self.decode is not None:
            d = self.decode
            out.update(decode_tokens=d.tokens, decode_valid=d.valid, decode_logprobs=d.logprobs)
            if self.decode_top:
                out.update(decode_top_ids=d.top_ids, decode_top_logprobs=d.top_logprobs)
        if self.prefill is not None:
            p = self.prefill
            out.update(prefill_tokens=p.tokens, prefill_logprobs=p.logprobs)
            if self.prefill_top:
                out.update(prefill_top_ids=p.top_ids, prefill_top_logprobs=p.top_logprobs)
            if p.prompt is not None:
                out.update(
                    prompt_logprobs=p.prompt.logprobs,
                    prompt_top_ids=p.prompt.top_ids,
                    prompt_top_logprobs=p.prompt.top_logprobs,
                )
        return out


logger = logging.getLogger(__name__)


def state_bytes(model_config: ModelConfig, engine_config: EngineConfig, num_pages: int) -> dict:
    """Device bytes of the KV pool and of the slot state (S slots, V vocab): the sampling state
    holds i32 token counts and two bool masks per slot and vocabulary entry."""
    c, e = model_config, engine_config
    per_token = kv_cache.bytes_per_token(
        c.num_layers, c.num_kv_heads, c.head_dim, e.kv_cache_dtype, e.dtype
    )
    slots = e.num_slots * (6 * c.vocab_size + 4 * e.max_pages_per_seq + 64)
    return {"kv_pool": num_pages * e.page_size * per_token, "slot_state": slots}


def device_memory_bytes() -> int:
    """Memory of the first device: the allocator's limit on a GPU, physical RAM on the CPU."""
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_memory(model_config: ModelConfig, engine_config: EngineConfig, num_pages: int) -> None:
    """ValueError naming num_slots / num_pages when the pool and slot state cannot fit, instead of
    an opaque allocation failure inside XLA."""
    need = state_bytes(model_config, engine_config, num_pages)
    have = device_memory_bytes()
    if sum(need.values()) > have:
        gib = lambda b: f"{b / 2**30:.1f} GiB"  # noqa: E731
        raise ValueError(
            f"num_slots={engine_config.num_slots} and num_pages={num_pages} need "
            f"{gib(need['kv_pool'])} of KV pages and {gib(need['slot_state'])} of slot state, "
            f"more than the device's {gib(have)}: lower num_slots, num_pages or kv_cache_memory"
        )


class ModelRunner:
    """Implements `jaxserve.core.runner_api.Runner` on the device.

    backend: the backend whose choices to make (`jaxserve.resolve`); default the one jax runs
    on, read once here. A test lowering a GPU engine's steps on the CPU passes "gpu".
    """

    def __init__(
        self,
        params,
        model_config: ModelConfig,
        engine_config: EngineConfig,
        num_pages: int,
        backend: str | None = None,
    ):
        engine_config = engine_config.for_model(model_config)  # a filled config comes back equal
        self.resolved: Resolved = resolve(
            engine_config, model_config, backend or jax.default_backend()
        )
        r = self.resolved
        params = with_matmul_impl(params, r.int4_matmul)
        if r.weight_layout == "out_in":
            params = {**params, "layers": linear.cpu_layout(params["layers"])}
        self.params = params
        self.model_config = model_config
        self.config = engine_config
        self.num_slots = engine_config.num_slots
        self.slot_buckets = r.slot_buckets
        check_memory(model_config, engine_config, num_pages)  # before anything is allocated
        self.cache = steps.init_cache(
            model_config,
            num_pages,
            engine_config.page_size,
            engine_config.kv_cache_dtype,
            engine_config.dtype,
        )
        self.state = steps.init_slot_state(self.num_slots, r.max_pages, model_config.vocab_size)
        self._page_table = np.zeros((self.num_slots, r.max_pages), np.int32)  # host mirror
        self._active = np.zeros((self.num_slots,), bool)  # host mirror of state.active
        self._dirty = False
        self.num_h2d_transfers = 0
        self.num_d2h_transfers = 0

    # -- the steps, one call each ------------------------------------------------------------------
    def generate(self, shape: DecodeShape, want_top: bool = False) -> steps.DecodeOutput:
        self.cache, self.state, out = steps.generate(
            self.params,
            self.cache,
            self.state,
            np.bool_(want_top),
            config=self.model_config,
            impl=self.resolved.model,
            shape=shape,
            num_steps=self.config.decode_steps,
        )
        return out

    def prefill(
        self, batch: input_batch.PrefillBatch, shape: PrefillShape, want_top: bool = False
    ) -> steps.PrefillOutput:
        self.cache, self.state, out = steps.prefill(
            self.params,
            self.cache,
            self.state,
            batch,
            np.bool_(want_top),
            config=self.model_config,
            impl=self.resolved.model,
            shape=shape,
        )
        return out

    # -- slot bookkeeping (host mirrors, flushed once per step) ----------------------------------
    def insert(self, req: Request) -> None:
        row = make_slot_row(
            req.sampling_params,
            req.prompt_token_ids,
            req.output_token_ids,
            req.eos_token_ids,
            req.seed,
            self.config.max_model_len,
        )
        self.state = steps.insert(
            self.state,
            np.int32(req.slot),
            row,
            np.int32(len(req.output_token_ids)),
            np.int32(req.max_total_len),
        )
        self._active[req.slot] = False
        self._dirty = True
        self.num_h2d_transfers += 1

    def move(self, moves: list[tuple[int, int]]) -> None:
        """Moves slot rows (a request changing slot, `Scheduler._compact`): one device copy."""
        self.state = steps.move(self.state, *input_batch.move_arrays(moves, self.num_slots))
        self.num_h2d_transfers += 1
        a, b = (list(x) for x in zip(*moves))
        self._page_table[b] = self._page_table[a]
        active = self._active[a].copy()
        self._page_table[a] = 0
        self._active[a] = False
        self._active[b] = active
        self._dirty = True

    def _set_pages(self, slot: int, pages: list[int]) -> None:
        self._page_table[slot, : len(pages)] = pages
        self._page_table[slot, len(pages) :] = 0
        self._dirty = True

    def _flush(self) -> None:
        if self._dirty:
            self.state = steps.sync(self.state, self._page_table.copy(), self._active.copy())
            self.num_h2d_transfers += 1
            self._dirty = False

    # -- one engine step ------------------------------------------------------------------------
    def dispatch(self, plan: SchedulerOutput) -> StepHandle:
        """Queues the plan's device work (asynchronously) and returns the handle to fetch."""
        for slot in plan.released:
            self._active[slot] = False
            self._dirty = True
        if plan.moves:
            self.move(plan.moves)
        for req in plan.inserted:
            self.insert(req)
        for slot, pages in plan.page_updates.items():
            self._set_pages(slot, pages)
        self._flush()

        handle = StepHandle()
        r = self.resolved
        if plan.decode:
            handle.decode_top = any(q.sampling_params.logprobs for q in plan.decode)
            shape = r.decode_shape(max(plan.decode_slots), [len(q.pages) for q in plan.decode])
            handle.decode = self.generate(shape, handle.decode_top)
        if plan.prefill:
            handle.prefill_top = any(c.request.sampling_params.logprobs for c in plan.prefill)
            shape = r.prefill_shape(
                len(plan.prefill),
                max(len(c.request.pages) for c in plan.prefill),
                input_batch.wants_prompt_logprobs(plan),
            )
            batch = input_batch.pack_prefill(plan, shape, self.num_slots, r.chunk)
            handle.prefill = self.prefill(batch, shape, handle.prefill_top)
            self.num_h2d_transfers += 1  # the packed batch
            for c in plan.prefill:
                if c.is_last:
                    self._active[c.request.slot] = True  # the device activated it too
        for x in handle.arrays().values():
            x.copy_to_host_async()  # the transfer starts as soon as the step is computed
        return handle

    def fetch(self, handle: StepHandle) -> StepResult:
        """Waits for a dispatched step and brings its outputs to the host in one transfer."""
        arrays = handle.arrays()
        if not arrays:
            return StepResult()
        host = jax.device_get(arrays)  # the step's one device->host transfer
        self.num_d2h_transfers += 1
        for name in ("tokens", "valid", "logprobs"):
            if "decode_" + name in host:  # scan stacks steps first: (k, S) -> (S, k)
                host["decode_" + name] = np.asarray(host["decode_" + name]).T
        for name in ("top_ids", "top_logprobs"):
            if "decode_" + name in host:
                host["decode_" + name] = np.asarray(host["decode_" + name]).transpose(1, 0, 2)
        return StepResult(**host)

    def warmup(self) -> float:
        """Compiles every step shape (`Resolved.decode_shapes` / `prefill_shapes`) and the slot
        updates; returns the seconds it took. All rows are padding (nothing active, no valid
        chunk), so the state is left as it was."""
        t0 = time.perf_counter()
        r, s = self.resolved, self.num_slots
        saved = self._active.copy()
        self._active[:] = False
        self._dirty = True
        self._flush()
        row = make_slot_row(SamplingParams(), [0], [], (), 0, self.config.max_model_len)
        self.state = steps.insert(self.state, np.int32(0), row, np.int32(0), np.int32(0))
        pad = np.full((s,), s, np.int32)
        self.state = steps.move(self.state, pad, pad)  # every row padding: nothing moves
        decode, prefill = r.decode_shapes(), r.prefill_shapes()
        for shape in decode:
            self.generate(shape)
        for shape in prefill:
            self.prefill(input_batch.padding_batch(shape.rows, s, r.chunk), shape)
        self._active[:] = saved
        self._dirty = True
        self._flush()
        jax.block_until_ready(self.state)
        dt = time.perf_counter() - t0
        logger.info(
            "warm-up: %d decode and %d prefill programs in %.1f s", len(decode), len(prefill), dt
        )
        return dt
