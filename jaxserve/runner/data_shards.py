"""Data parallelism in the runner: D data shards of S/D slots and N/D KV pages each, one step
program for all of them (`data_parallel.py`); D = 1 is one group, nothing split.

    DataShards(num_slots, num_pages, data_parallel_size)
      .steps                           the step functions: `steps`, or `data_parallel`'s SPMD ones
      .decode_shape(resolved, plan)    the decode program of the plan's rows (one shard's shape)
      .prefill_shape(resolved, plan)   the prefill program of the plan's chunks (one shard's)
      .pack_prefill(plan, shape)       -> (batch of D blocks of shape.rows, packed row of each chunk)
      .padding_batch(shape)            D blocks of padding rows (warm-up)
      .to_host(handle)                 a step's outputs on the host, by global slot and plan order

The host's schedulers give shard d the slots [d*S/D, (d+1)*S/D) and pages numbered locally
(`core/data_parallel.py`); each shard's program lists only its own rows and pages, so a step's
shape is the largest any shard needs.
"""

from __future__ import annotations

from jaxserve.core.scheduler_output import SchedulerOutput
from jaxserve.resolve import PrefillShape, Resolved
from jaxserve.runner import data_parallel, input_batch, steps
from jaxserve.runner.step_handle import StepHandle, fetch_outputs


class DataShards:
    """The runner's data shards (`count`, `slots_per_shard`) and the step functions they run."""

    def __init__(self, num_slots: int, num_pages: int, data_parallel_size: int):
        d = data_parallel_size
        if num_pages % d:
            raise ValueError(
                f"num_pages ({num_pages}) must be a multiple of data_parallel_size ({d})"
            )
        self.count = d
        self.num_slots = num_slots
        self.slots_per_shard = num_slots // d
        self.steps = data_parallel if d > 1 else steps  # generate / prefill (one shard or all)

    def decode_shape(self, resolved: Resolved, plan: SchedulerOutput):
        """The decode shape: the rows up to the highest decoding slot within its shard, the most
        pages any one shard's rows hold."""
        per = self.slots_per_shard
        last = max(slot % per for slot in plan.decode_slots)
        live = [0] * self.count
        for slot, q in zip(plan.decode_slots, plan.decode):
            live[slot // per] += len(q.pages)
        return resolved.decode_shape(last, [len(q.pages) for q in plan.decode], max(live))

    def prefill_shape(self, resolved: Resolved, plan: SchedulerOutput) -> PrefillShape:
        """The prefill shape: the most chunks any one shard runs, the longest chunk, the most
        pages of a chunk's sequence."""
        return resolved.prefill_shape(
            max(input_batch.shard_rows(plan, self.num_slots, self.count)) + 1,
            max(c.length for c in plan.prefill),
            max(len(c.request.pages) for c in plan.prefill),
            input_batch.wants_prompt_logprobs(plan),
        )

    def pack_prefill(self, plan: SchedulerOutput, shape: PrefillShape):
        """(PrefillBatch of D blocks of shape.rows rows, packed row of each plan.prefill[i])."""
        return input_batch.pack_prefill_shards(plan, shape, self.num_slots, self.count)

    def padding_batch(self, shape: PrefillShape) -> input_batch.PrefillBatch:
        rows = shape.rows * self.count
        return input_batch.padding_batch(rows, self.slots_per_shard, shape.chunk)

    def to_host(self, handle: StepHandle) -> dict:
        """The handle's outputs as numpy arrays in the engine's indexing ({}: it ran nothing)."""
        return fetch_outputs(handle, self.count, self.slots_per_shard)
