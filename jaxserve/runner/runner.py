"""`ModelRunner`: the one device-facing object. It owns the params, the paged KV cache and the slot
state, and runs scheduler plans through the jitted steps of `steps.py`.

    dispatch(plan, masks)
                     queues one engine step, in this order: release / move / insert / page-table
                     sync (host mirrors, one `sync` transfer), the step's grammar masks, then the
                     decode step (the slots that were decoding before this step), then the
                     prefill; returns a handle
    dispatch(plan, masks_later=True), then complete(handle, masks)
                     the same, where the masks are computed while the decode forward runs
    fetch(handle)    ONE device->host transfer of the step's new tokens (and log-probs when a
                     request asked) -> StepResult

It is built from a finished `Blueprint` (`runner/blueprint.py`: the config filled for the model,
the mesh, the resolved choices, the pool's pages), and derives nothing of its own. The step's
features are objects of their own, built once with the blueprint's choices:

    shards           `DataShards`: data parallelism (the step shapes and batches of D shards)
    structured       `StructuredDecoding`: the grammar masks, and the decode step's program(s)
    prefill_strategy `PrefillStrategy`: the prefill step as one program or two
    speculative      `SpeculativeDecoding`: n-gram drafts verified in one step (a plan that
                     speculates runs it instead of the decode step)
    lora             `LoRAStacks`: the adapters' device slots (with enable_lora)

JAX dispatch is asynchronous, so the engine can dispatch the next step before fetching this one.
Each step runs in the smallest compiled shape that holds it (`jaxserve.resolve`: decode row, width
and flat-page buckets; prefill row and width buckets); `warmup()` compiles every shape
`Resolved.decode_shapes()` / `prefill_shapes()` lists, after which nothing recompiles
(tests/runner/test_runner.py). Every host->device and device->host transfer is counted.
"""

from __future__ import annotations

import contextlib
import logging

import jax
import numpy as np

from jaxserve.core.request import Request
from jaxserve.core.runner_api import StepResult
from jaxserve.core.scheduler_output import SchedulerOutput
from jaxserve.core.slot_row import make_slot_row
from jaxserve.core.structured_outputs import GrammarMasks
from jaxserve.resolve import DecodeShape, PrefillShape
from jaxserve.runner import (
    compile_cache,
    device_state,
    input_batch,
    lora_stacks,
    memory,
    slot_state,
    steps,
    warmup,
)
from jaxserve.runner.blueprint import Blueprint
from jaxserve.runner.data_shards import DataShards
from jaxserve.runner.prefill_strategy import PrefillStrategy
from jaxserve.runner.speculative_decoding import SpeculativeDecoding
from jaxserve.runner.step_handle import StepHandle
from jaxserve.runner.structured_decoding import StructuredDecoding

logger = logging.getLogger(__name__)


class ModelRunner:
    """Implements `jaxserve.core.runner_api.Runner` on the device.

    params: the loaded weights (on their shards already where the loader placed them).
    blueprint: everything decided before this (`runner.blueprint.blueprint`, which
    `engine_args.build_engine` calls): the config filled for the model, the model config with
    its KV heads replicated up to T, the mesh (None: one device), the resolved choices of one
    data shard, the pool's pages.
    The runner derives nothing of its own: it lays out the params, allocates the pool and slot
    state, and hands each of its parts the groups it reads (`config.scheduler`, ...).
    """

    def __init__(self, params, blueprint: Blueprint):
        e, r = blueprint.engine_config, blueprint.resolved
        self.blueprint = blueprint
        self.mesh = blueprint.mesh
        self.config = e
        self.model_config = model_config = blueprint.model_config
        self.resolved = r
        self.num_slots = e.scheduler.num_slots
        self.num_pages = blueprint.num_pages  # the engine's allocator takes this count
        self.slot_buckets = r.slot_buckets
        self.shards = DataShards(self.num_slots, blueprint.num_pages, blueprint.data_shards)
        # this process's persistent compilation cache (the blueprint chose its autotuning folder)
        self.compilation_cache_dir = compile_cache.enable(e.compilation.compilation_cache)
        params = device_state.layout_params(params, blueprint)
        self.lora = None
        if e.lora.enable_lora:  # an adapter's wk / wv columns follow the KV heads' copies
            self.lora = lora_stacks.LoRAStacks(
                params, model_config, e.lora, blueprint.mesh, blueprint.kv_columns
            )
            params = {**params, "lora": self.lora.stacks}
        self.params = params
        init = device_state.state_fns(blueprint)
        self.cache, self.state = device_state.allocate(*init, blueprint.mesh, blueprint.data_shards)
        # the step's features, which run the steps over what the runner holds
        self.structured = StructuredDecoding(e.scheduler, r, model_config, self.shards)
        self.speculative = SpeculativeDecoding(e.speculative, r, model_config)
        self.prefill_strategy = PrefillStrategy(r, model_config, self.shards, blueprint.mesh)
        self._page_table = np.zeros((self.num_slots, r.max_pages), np.int32)  # host mirror
        self._active = np.zeros((self.num_slots,), bool)  # host mirror of state.active
        self._dirty = False
        self.num_h2d_transfers = 0
        self.num_d2h_transfers = 0
        self.workspace_bytes: int | None = None  # XLA temp bytes of the largest steps (warm-up)
        logger.info(memory.describe(self.memory_plan()))

    @property
    def overlaps_grammar(self) -> bool:
        """A step's grammar masks may come after its decode forward (`StructuredDecoding`)."""
        return self.structured.overlaps

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

    # -- the steps, one call each ------------------------------------------------------------------
    def generate(self, shape: DecodeShape, want_top: bool = False) -> steps.DecodeOutput:
        """A decode step of the first shape.rows slots (`StructuredDecoding.decode`)."""
        with self._on_mesh():
            self.cache, self.state, out = self.structured.decode(
                self.params, self.cache, self.state, want_top, shape
            )
        return out

    def speculate(self, shape: DecodeShape, limit: np.ndarray, drafts: int) -> steps.DecodeOutput:
        """A speculative decode step of the first shape.rows slots (`spec_decode.speculate`),
        `drafts` a row; limit i32[S]: the most tokens each slot may make (0 = it does not move)."""
        self.num_h2d_transfers += 1  # the limits
        with self._on_mesh():
            self.cache, self.state, out = self.speculative(
                self.params, self.cache, self.state, limit, shape, drafts
            )
        return out

    def speculative_shapes(self) -> list[tuple[DecodeShape, int]]:
        """`Resolved.speculative_shapes`: what a speculative step may run (none without)."""
        return self.speculative.shapes()

    def prefill(
        self, batch: input_batch.PrefillBatch, shape: PrefillShape, want_top: bool = False
    ) -> steps.PrefillOutput:
        """A prefill step of `batch` (`PrefillStrategy`: one program or two)."""
        with self._on_mesh():
            self.cache, self.state, out = self.prefill_strategy(
                self.params, self.cache, self.state, batch, want_top, shape
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
            self.config.scheduler.max_model_len,
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

    def _change_slots(self, plan: SchedulerOutput) -> None:
        """The plan's slot changes into the host mirrors and the state; one page-table sync."""
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

    def _install(self, masks: GrammarMasks | None) -> None:
        if masks is not None:
            self.state = self.structured.install(self.state, masks)
            self.num_h2d_transfers += 1

    # -- one engine step ------------------------------------------------------------------------
    def dispatch(
        self, plan: SchedulerOutput, masks: GrammarMasks | None = None, masks_later: bool = False
    ) -> StepHandle:
        """Queues the plan's device work (asynchronously) and returns the handle to fetch.
        masks: the grammar masks of the step's constrained rows. masks_later: they come by
        `complete` (a plan that decodes, on a runner that `overlaps_grammar`): only the decode
        forward is queued now."""
        with self._on_mesh():
            self._change_slots(plan)
            handle = StepHandle.of(plan)
            if masks_later:
                return self._queue_forward(plan, handle)  # `complete` does the rest
            self._install(masks)
            self._dispatch_decode(plan, handle)
            self._dispatch_prefill(plan, handle)
        return handle

    def complete(self, handle: StepHandle, masks: GrammarMasks) -> StepHandle:
        """Finishes a step dispatched with masks_later: installs its grammar masks, samples the
        decode rows from the forward's logits, then queues the prefill (as `dispatch` would)."""
        with self._on_mesh():
            plan, logits, shape = handle.pending
            handle.pending = None
            self._install(masks)
            self.state, handle.decode = self.structured.sample(
                self.state, logits, handle.decode_top, shape
            )
            self._dispatch_prefill(plan, handle)
        return handle

    def _queue_forward(self, plan: SchedulerOutput, handle: StepHandle) -> StepHandle:
        shape = self.shards.decode_shape(self.resolved, plan)
        self.cache, logits = self.structured.forward(self.params, self.cache, self.state, shape)
        handle.pending = (plan, logits, shape)
        return handle

    def _dispatch_decode(self, plan: SchedulerOutput, handle: StepHandle) -> None:
        if not plan.decode:
            return
        shape = self.shards.decode_shape(self.resolved, plan)
        if plan.speculative:
            limit = self.speculative.limits(plan, self.num_slots)
            handle.decode = self.speculate(shape, limit, plan.num_decode_steps - 1)
        else:
            handle.decode = self.generate(shape, handle.decode_top)

    def _dispatch_prefill(self, plan: SchedulerOutput, handle: StepHandle) -> None:
        if plan.prefill:
            shape = self.shards.prefill_shape(self.resolved, plan)
            batch, handle.prefill_rows = self.shards.pack_prefill(plan, shape)
            handle.prefill = self.prefill(batch, shape, handle.prefill_top)
            self.num_h2d_transfers += 1  # the packed batch
            for c in plan.prefill:
                if c.is_last:
                    self._active[c.request.slot] = True  # the device activated it too
        handle.start_copies()

    def fetch(self, handle: StepHandle) -> StepResult:
        """Waits for a dispatched step and brings its outputs to the host in one transfer."""
        host = self.shards.to_host(handle)
        if host:
            self.num_d2h_transfers += 1  # the step's one device->host transfer
        return StepResult.from_arrays(host)

    def warmup(self) -> float:
        """Compiles every step shape (`Resolved.decode_shapes` / `prefill_shapes`) and the slot
        updates; returns the seconds it took. All rows are padding (nothing active, no valid
        chunk), so the state is left as it was."""
        with self._on_mesh():
            return warmup.warmup(self)
