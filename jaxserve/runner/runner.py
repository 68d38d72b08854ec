"""`ModelRunner`: the one device-facing object. It owns the params, the paged KV cache and the slot
state, and runs scheduler plans through the jitted steps of `steps.py`.

    dispatch(plan, masks)
                     queues one engine step, in this order: release / move / insert / page-table
                     sync (host mirrors, one `sync` transfer), the step's grammar masks, then
                     `generate` (the slots that were decoding before this step), then `prefill`;
                     returns a handle
    dispatch(plan, masks_later=True), then complete(handle, masks)
                     for a step whose structured-output masks come late: dispatch runs only the
                     decode forward; complete installs the masks the host computed meanwhile,
                     samples, then queues the prefill
                     (a plan whose decode rows speculate runs `spec_decode.speculate` instead
                     of `generate`: up to k + 1 tokens a row)
    fetch(handle)    ONE device->host transfer of the step's new tokens (and log-probs when a
                     request asked) -> StepResult

JAX dispatch is asynchronous, so the engine can dispatch the next step before fetching this one.
Each step runs in the smallest compiled shape that holds it (`jaxserve.resolve`: decode row, width
and flat-page buckets; prefill row and width buckets); `warmup()` compiles every shape
`Resolved.decode_shapes()` / `prefill_shapes()` lists, after which nothing recompiles
(tests/runner/test_runner.py). On one device group (no data shards) a decode step is two
programs, the forward (one per shape) then the sampling (one per row bucket:
`steps.decode_sample`); so is a prefill step where there are page-table width buckets
(`prefill_sample`), so the sampler is not compiled again into every width's program.
Every host->device and device->host transfer is counted.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.core.request import Request
from jaxserve.core.runner_api import StepResult
from jaxserve.core.scheduler_output import SchedulerOutput
from jaxserve.core.slot_row import make_slot_row
from jaxserve.core.structured_outputs import GrammarMasks
from jaxserve.layers.embedding import is_quantized
from jaxserve.parallel import partition
from jaxserve.resolve import (
    DecodeShape,
    PrefillShape,
    Resolved,
    data_shard_config,
    resolve,
)
from jaxserve.runner import (
    compile_cache,
    cpu_backend,
    data_parallel,
    device_state,
    input_batch,
    lora_stacks,
    memory,
    slot_state,
    spec_decode,
    steps,
    warmup,
)
from jaxserve.runner.memory import check_memory, device_memory_bytes, state_bytes  # noqa: F401
from jaxserve.runner.step_handle import StepHandle, fetch_outputs

logger = logging.getLogger(__name__)


class ModelRunner:
    """Implements `jaxserve.core.runner_api.Runner` on the device.

    backend: the backend whose choices to make (`jaxserve.resolve`); default the one jax runs
    on, read once here. A test lowering a GPU engine's steps on the CPU passes "gpu".
    mesh: a ('data', 'model') `jax.sharding.Mesh` to run on (`jaxserve.parallel`); default one
    of engine_config.data_parallel_size x tensor_parallel_size devices, needed when either
    exceeds 1 (`engine_args.build_engine` makes it), else none (one device, nothing sharded).
    engine_config: filled for the model (`EngineConfig.for_model`); the runner derives no config
    of its own but one data shard's (`resolve.data_shard_config`).
    """

    def __init__(
        self,
        params,
        model_config: ModelConfig,
        engine_config: EngineConfig,
        num_pages: int,
        backend: str | None = None,
        mesh=None,
    ):
        device_state.check_built(engine_config, mesh)
        t, d = engine_config.tensor_parallel_size, engine_config.data_parallel_size
        kv_cols = None
        if mesh is not None:
            # the KV heads copied up to T where T exceeds them; an adapter's wk / wv columns
            # follow the same map (`lora_stacks.LoRAStacks`)
            kv_cols = lora_stacks.kv_columns(model_config, t)
            params, model_config = partition.replicate_kv_heads(params, model_config, t)
        self.mesh = mesh
        self.data_shards = d
        self.slots_per_shard = engine_config.num_slots // d
        if num_pages % d:
            raise ValueError(
                f"num_pages ({num_pages}) must be a multiple of data_parallel_size ({d})"
            )
        shard_config = data_shard_config(engine_config)  # the step shapes are one shard's
        backend = backend or jax.default_backend()
        self.compilation_cache_dir = compile_cache.enable(engine_config.compilation_cache)
        autotune = (
            compile_cache.autotune_dir(self.compilation_cache_dir) if backend == "gpu" else None
        )
        self.resolved: Resolved = resolve(
            shard_config,
            model_config,
            backend,
            cpu_kernel=cpu_backend.attention_kernel(backend, engine_config),
            cpu_matmul=cpu_backend.matmul_kernel(backend, engine_config, mesh),
            plain_weights=not any(map(is_quantized, params["layers"].values())),
            autotune_cache_dir=autotune,
            device_kind=jax.devices()[0].device_kind if backend == "gpu" else None,
        )
        self.step_fns = data_parallel if d > 1 else steps  # generate / prefill (one shard or all)
        r = self.resolved
        params = device_state.layout_params(params, model_config, r, mesh)
        self.lora = None
        if engine_config.enable_lora:
            self.lora = lora_stacks.LoRAStacks(params, model_config, engine_config, mesh, kv_cols)
            params = {**params, "lora": self.lora.stacks}
        self.params = params
        self.model_config = model_config
        self.config = engine_config
        self.num_slots = engine_config.num_slots
        self.slot_buckets = r.slot_buckets
        # One token per step on one device group: every decode step runs as two programs,
        # forward then sample (steps.decode_forward / decode_sample, equal to generate's one
        # step), so a structured-output step's host masks can overlap its forward pass.
        self.overlaps_grammar = d == 1 and engine_config.decode_steps == 1
        # Prefill likewise (steps.prefill_forward / prefill_sample, equal to prefill) where it
        # saves compiling: with page-table width buckets (a GPU's 8-10) the sampler is compiled
        # once per row bucket instead of into every width's program (JOURNAL.md 45: 'ragged' on
        # CPU warms up in 0.53-0.55x the time). With one width (the C++ CPU kernel) it would
        # save nothing and cost a program launch per step, so that prefill stays one program.
        self.splits_prefill = d == 1 and len({s.width for s in r.prefill_shapes()}) > 1
        if r.model.attention in ("pallas", "mgpu"):  # both run the Pallas prefill kernel
            num_pages = memory.pallas_pool_pages(num_pages, model_config, engine_config)
        self.num_pages = num_pages  # the pool's pages (the engine's allocator takes this count)
        check_memory(model_config, engine_config, num_pages)  # before anything is allocated

        init = device_state.state_fns(model_config, engine_config, r, num_pages)
        self.cache, self.state = device_state.allocate(*init, mesh, d)
        self._page_table = np.zeros((self.num_slots, r.max_pages), np.int32)  # host mirror
        self._active = np.zeros((self.num_slots,), bool)  # host mirror of state.active
        self._dirty = False
        self.num_h2d_transfers = 0
        self.num_d2h_transfers = 0
        self.workspace_bytes: int | None = None  # XLA temp bytes of the largest steps (warm-up)
        logger.info(memory.describe(self.memory_plan()))

    def load_lora(self, slot: int, adapter) -> None:
        """Adapter `adapter` (None: zeros) into device slot `slot`, in place (no recompile)."""
        self.params = {**self.params, "lora": self.lora.write(self.params["lora"], slot, adapter)}
        self.num_h2d_transfers += 1

    def memory_plan(self) -> dict:
        """Per-device bytes of params, KV pool, slot state and workspace (`runner/memory.py`)."""
        return memory.memory_plan(self)

    def _on_mesh(self):
        """The context the steps run in: the mesh, so layers see its axes while tracing."""
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def _jit(self, step):
        """A step function (`runner.jit_step.Step`) jitted with this engine's XLA options."""
        return step.jit(self.resolved.compiler_options)

    def on_device(self, tree):
        """Host arrays onto the device (replicated over the mesh, if any), for a step's inputs
        that two programs read."""
        if self.mesh is None:
            return jax.device_put(tree)
        return jax.tree.map(lambda x: partition.place(x, NamedSharding(self.mesh, P())), tree)

    # -- the steps, one call each ------------------------------------------------------------------
    def generate(self, shape: DecodeShape, want_top: bool = False) -> steps.DecodeOutput:
        with self._on_mesh():
            if self.overlaps_grammar:
                logits = self._decode_forward(shape)
                self.state, out = self._jit(steps.decode_sample)(
                    self.state, logits, np.bool_(want_top), num_top=shape.num_top
                )
                return out
            self.cache, self.state, out = self._jit(self.step_fns.generate)(
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

    def speculate(self, shape: DecodeShape, limit: np.ndarray, drafts: int) -> steps.DecodeOutput:
        """A speculative decode step of the first shape.rows slots (`spec_decode.speculate`),
        `drafts` a row; limit i32[S]: the most tokens each slot may make (0 = it does not move)."""
        c = self.config
        self.num_h2d_transfers += 1  # the limits
        with self._on_mesh():
            self.cache, self.state, out = self._jit(spec_decode.speculate)(
                self.params,
                self.cache,
                self.state,
                limit,
                config=self.model_config,
                impl=self.resolved.model,
                shape=shape,
                num_spec=drafts,
                min_n=c.prompt_lookup_min,
                max_n=c.prompt_lookup_max,
            )
        return out

    def speculative_shapes(self) -> list[tuple[DecodeShape, int]]:
        """`Resolved.speculative_shapes`: what a speculative step may run (none without)."""
        return self.resolved.speculative_shapes(self.config)

    def _decode_forward(self, shape: DecodeShape):
        self.cache, logits = self._jit(steps.decode_forward)(
            self.params,
            self.cache,
            self.state,
            config=self.model_config,
            impl=self.resolved.model,
            shape=shape,
        )
        return logits

    def prefill(
        self, batch: input_batch.PrefillBatch, shape: PrefillShape, want_top: bool = False
    ) -> steps.PrefillOutput:
        prefill = self._jit(self.step_fns.prefill)
        if self.splits_prefill:  # forward then sample: one sampler program per row bucket
            options = self.resolved.compiler_options
            prefill = functools.partial(steps.prefill_in_two, options=options)
            batch = self.on_device(batch)
        with self._on_mesh():
            self.cache, self.state, out = prefill(
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
        self.state = self._jit(slot_state.insert)(
            self.state,
            np.int32(req.slot),
            row,
            np.int32(len(req.output_token_ids)),
            np.int32(req.max_total_len),
            np.int32(req.lora_slot),
        )
        self._active[req.slot] = False
        self._dirty = True
        self.num_h2d_transfers += 1

    def move(self, moves: list[tuple[int, int]]) -> None:
        """Moves slot rows (a request changing slot, `Scheduler._compact`): one device copy."""
        self.state = self._jit(slot_state.move)(
            self.state, *input_batch.move_arrays(moves, self.num_slots)
        )
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
            self.state = self._jit(slot_state.sync)(
                self.state, self._page_table.copy(), self._active.copy()
            )
            self.num_h2d_transfers += 1
            self._dirty = False

    # -- one engine step ------------------------------------------------------------------------
    def dispatch(
        self, plan: SchedulerOutput, masks: GrammarMasks | None = None, masks_later: bool = False
    ) -> StepHandle:
        """Queues the plan's device work (asynchronously) and returns the handle to fetch.
        masks: the grammar masks of the step's constrained rows. masks_later: they come by
        `complete` (a plan that decodes, on a runner that `overlaps_grammar`): only the decode
        forward is queued now."""
        with self._on_mesh():
            return self._dispatch(plan, masks, masks_later)

    def _dispatch(self, plan: SchedulerOutput, masks, masks_later: bool) -> StepHandle:
        for slot in plan.released:
            self._active[slot] = False
            self._dirty = True
        if plan.moves:
            self.move(plan.moves)
        for slot, adapter in plan.lora_loads:
            self.load_lora(slot, adapter)
        for req in plan.inserted:
            self.insert(req)
        for slot, pages in plan.page_updates.items():
            self._set_pages(slot, pages)
        self._flush()
        deferred = masks_later and bool(plan.decode)
        if deferred and not self.overlaps_grammar:
            raise ValueError("this runner computes a step's grammar masks before it (no overlap)")
        if not deferred:
            self._set_grammar(masks)

        handle = StepHandle()
        r = self.resolved
        if plan.decode:
            # logprobs=0 too: the top entries give the sampled token's rank
            handle.decode_top = any(q.sampling_params.logprobs is not None for q in plan.decode)
            last = max(slot % self.slots_per_shard for slot in plan.decode_slots)  # in its shard
            live = [0] * self.data_shards  # each shard's program lists its own rows' pages
            for slot, q in zip(plan.decode_slots, plan.decode):
                live[slot // self.slots_per_shard] += len(q.pages)
            shape = r.decode_shape(last, [len(q.pages) for q in plan.decode], max(live))
            if plan.speculative:
                limit = np.zeros((self.num_slots,), np.int32)
                limit[plan.decode_slots] = plan.decode_steps
                handle.decode = self.speculate(shape, limit, plan.num_decode_steps - 1)
                self._dispatch_prefill(plan, handle)
                return handle
            if deferred:
                handle.pending = (plan, self._decode_forward(shape), shape)
                return handle  # `complete` samples once the masks are in
            handle.decode = self.generate(shape, handle.decode_top)
        self._dispatch_prefill(plan, handle)
        return handle

    def complete(self, handle: StepHandle, masks: GrammarMasks) -> StepHandle:
        """Finishes a step dispatched with masks_later: installs its grammar masks, samples the
        decode rows from the forward's logits, then queues the prefill (as `dispatch` would)."""
        with self._on_mesh():
            plan, logits, shape = handle.pending
            handle.pending = None
            self._set_grammar(masks)
            self.state, handle.decode = self._jit(steps.decode_sample)(
                self.state, logits, np.bool_(handle.decode_top), num_top=shape.num_top
            )
            self._dispatch_prefill(plan, handle)
        return handle

    def _set_grammar(self, masks: GrammarMasks | None) -> None:
        if masks is not None:
            self.state = self._jit(slot_state.set_grammar)(self.state, masks.bitmask, masks.rows)
            self.num_h2d_transfers += 1

    def _dispatch_prefill(self, plan: SchedulerOutput, handle: StepHandle) -> None:
        r = self.resolved
        if plan.prefill:
            handle.prefill_top = any(
                c.request.sampling_params.logprobs is not None for c in plan.prefill
            )
            d = self.data_shards
            shape = r.prefill_shape(
                max(input_batch.shard_rows(plan, self.num_slots, d)) + 1,  # chunks per shard
                max(c.length for c in plan.prefill),
                max(len(c.request.pages) for c in plan.prefill),
                input_batch.wants_prompt_logprobs(plan),
            )
            batch, handle.prefill_rows = input_batch.pack_prefill_shards(
                plan, shape, self.num_slots, d
            )
            handle.prefill = self.prefill(batch, shape, handle.prefill_top)
            self.num_h2d_transfers += 1  # the packed batch
            for c in plan.prefill:
                if c.is_last:
                    self._active[c.request.slot] = True  # the device activated it too
        for x in handle.arrays().values():
            if x.is_fully_addressable:  # (a multi-host step's outputs are gathered in fetch)
                x.copy_to_host_async()  # the transfer starts as soon as the step is computed

    def fetch(self, handle: StepHandle) -> StepResult:
        """Waits for a dispatched step and brings its outputs to the host in one transfer."""
        host = fetch_outputs(handle, self.data_shards, self.slots_per_shard)
        if host:
            self.num_d2h_transfers += 1  # the step's one device->host transfer
        return StepResult.from_arrays(host)

    def warmup(self) -> float:
        """Compiles every step shape (`Resolved.decode_shapes` / `prefill_shapes`) and the slot
        updates; returns the seconds it took. All rows are padding (nothing active, no valid
        chunk), so the state is left as it was."""
        with self._on_mesh():
            return warmup.warmup(self)
