"""Data parallelism on the host: one `Scheduler` per data shard, merged into one plan per step.

    make_scheduler(config, num_pages, slot_buckets) -> Scheduler | DataParallelScheduler

With data_parallel_size D, shard d owns slots [d*S/D, (d+1)*S/D) and its own N/D KV pages (page
ids local to the shard: the device pool is split over the mesh's 'data' axis, each shard's pages
on its devices). Each shard schedules on its own (its queue, preemption, prefix cache, slot
compaction within its range) and the plans are concatenated, so a step runs every shard's work in
one SPMD program (`runner/data_parallel.py`).

A new request goes to the shard with the fewest queued and running requests, the lowest index on a
tie; the n samples of one request stay on one shard (they share its prompt pages). The choice
depends only on the order requests arrive in, never on time or set order, so every process of a
multi-host run makes the same plans from the same inputs.
"""

from __future__ import annotations

import collections
import dataclasses

from jaxserve.config import EngineConfig
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.scheduler_output import SchedulerOutput


def make_scheduler(config: EngineConfig, num_pages: int, slot_buckets=None, loras=None):
    """One Scheduler, or one per data shard behind the same interface (LoRA adapter slots
    `loras` with one only: EngineConfig refuses enable_lora with data parallelism); each given
    the filled config's groups it reads."""
    if config.parallel.data_parallel_size == 1:
        return Scheduler(
            config.scheduler,
            config.cache,
            num_pages,
            slot_buckets,
            loras=loras,
            speculative=config.speculative,
        )
    return DataParallelScheduler(config, num_pages, slot_buckets)


@dataclasses.dataclass
class PoolTotals:
    """The shards' page allocators summed (what the engine's stats read)."""

    num_used_pages: int
    num_shared_refs: int
    num_free_pages: int


class DataParallelScheduler:
    """`Scheduler`'s interface over D shard schedulers (slots offset per shard, pages local)."""

    def __init__(self, config: EngineConfig, num_pages: int, slot_buckets=None):
        d = config.parallel.data_parallel_size
        if num_pages % d:
            raise ValueError(
                f"num_pages ({num_pages}) must be a multiple of data_parallel_size ({d})"
            )
        self.slots_per_shard = config.scheduler.num_slots // d
        self.pages_per_shard = num_pages // d
        # one shard's slots (its decode row buckets are the runner's, `slot_buckets`)
        local = dataclasses.replace(
            config.scheduler, num_slots=self.slots_per_shard, slot_buckets="auto"
        )
        self.shards = [
            Scheduler(
                local,
                config.cache,
                self.pages_per_shard,
                slot_buckets,
                slot_offset=i * self.slots_per_shard,
                speculative=config.speculative,  # (off: EngineConfig refuses it with shards)
            )
            for i in range(d)
        ]
        self._group_shard: dict[str, list[int]] = {}  # group id -> [shard, live children]
        self._shard_of: dict[str, int] = {}  # request id -> shard

    # -- queue ------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        entry = self._group_shard.get(request.group_id)
        if entry is None:
            load = [len(s.waiting) + len(s.running) for s in self.shards]
            entry = self._group_shard[request.group_id] = [load.index(min(load)), 0]
        entry[1] += 1
        self._shard_of[request.request_id] = entry[0]
        self.shards[entry[0]].add(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        shard = self._shard_of.pop(request.request_id, None)
        if shard is None:
            return
        self.shards[shard].finish(request, status)
        entry = self._group_shard[request.group_id]
        entry[1] -= 1
        if entry[1] == 0:
            del self._group_shard[request.group_id]

    def shard_of_slot(self, slot: int) -> int:
        return slot // self.slots_per_shard

    def has_unfinished(self) -> bool:
        return any(s.has_unfinished() for s in self.shards)

    def reset_prefix_cache(self) -> bool:
        if self.has_unfinished():
            return False
        return all([s.reset_prefix_cache() for s in self.shards])

    # -- the plan -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Every shard's plan, concatenated (slots are global, pages local to their shard)."""
        plans = [s.schedule() for s in self.shards]
        out = SchedulerOutput(num_decode_steps=plans[0].num_decode_steps)
        for p in plans:
            for f in dataclasses.fields(SchedulerOutput):
                if f.name in (
                    "num_decode_steps",
                    "speculative",  # (never with data shards: EngineConfig refuses it)
                ):
                    continue
                mine, theirs = getattr(out, f.name), getattr(p, f.name)
                if isinstance(mine, dict):
                    mine.update(theirs)
                else:
                    mine.extend(theirs)
        return out

    # -- what the engine's stats read -------------------------------------------------------------
    @property
    def running(self) -> list[Request]:
        return [r for s in self.shards for r in s.running]

    @property
    def waiting(self) -> collections.deque[Request]:
        return collections.deque(r for s in self.shards for r in s.waiting)

    @property
    def allocator(self) -> PoolTotals:
        a = [s.allocator for s in self.shards]
        return PoolTotals(
            sum(x.num_used_pages for x in a),
            sum(x.num_shared_refs for x in a),
            sum(x.num_free_pages for x in a),
        )

    def __getattr__(self, name):  # counters: num_preemptions, num_cached_tokens, ... summed
        if name in _SUMMED:
            return sum(getattr(s, name) for s in self.__dict__["shards"])
        raise AttributeError(name)


_SUMMED = (
    "num_preemptions",
    "num_cached_tokens",
    "num_slot_moves",
    "decode_rows_sum",
    "num_decode_plans",
)
