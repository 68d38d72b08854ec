"""The plan of one engine step (vLLM's `SchedulerOutput`): what `Scheduler.schedule()` hands the
engine, and the engine the runner. Host only (no jax).

A plan says two things, applied by the runner in this order:

    slot changes   released (slots freed since the last plan; everything they held is gone),
                   moves (from, to), lora_loads (slot, adapter), inserted (requests newly given a
                   slot), page_updates (slot -> its whole page list)
    the step       decode (requests that generate num_decode_steps tokens each, fewer near their
                   length limit) and prefill (one `PrefillChunk` per request with prompt left)

`preempted` lists the requests this plan sent back to the waiting queue. decode_slots,
decode_steps and forced are fixed by `Scheduler._commit` as the plan is made (the requests move on
before its results come back). Nothing changes a plan once it is made: the step's grammar masks,
computed by the engine from the plan, go to the runner beside it (`Runner.dispatch`).
"""

from __future__ import annotations

import dataclasses

from jaxserve.core.request import Request


@dataclasses.dataclass
class PrefillChunk:
    request: Request
    start: int  # position of the chunk's first token
    length: int  # tokens in the chunk, <= prefill_chunk_size
    is_last: bool  # the chunk completes the prefill: sample (or install) the next token

    @property
    def token_ids(self) -> list[int]:
        return self.request.all_token_ids[self.start : self.start + self.length]


@dataclasses.dataclass
class SchedulerOutput:
    decode: list[Request] = dataclasses.field(default_factory=list)
    prefill: list[PrefillChunk] = dataclasses.field(default_factory=list)
    inserted: list[Request] = dataclasses.field(default_factory=list)  # newly given a slot
    released: list[int] = dataclasses.field(default_factory=list)  # slots freed since last plan
    preempted: list[Request] = dataclasses.field(default_factory=list)
    page_updates: dict[int, list[int]] = dataclasses.field(default_factory=dict)  # slot -> pages
    moves: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (from, to) slot
    num_decode_steps: int = 1
    # the decode rows speculate (`runner/spec_decode.py`): each makes 1 to num_decode_steps
    # tokens, and decode_steps[i] is only the most decode[i] may make
    speculative: bool = False
    # Fixed when the plan is made (requests move on before its results come back):
    decode_slots: list[int] = dataclasses.field(default_factory=list)  # slot of each decode[i]
    decode_steps: list[int] = dataclasses.field(default_factory=list)  # tokens each decode[i] makes
    forced: list[bool] = dataclasses.field(default_factory=list)  # prefill[i] installs a token
    # LoRA adapters to load into their device slots before the step (slot, `lora.peft.LoRAAdapter`)
    lora_loads: list = dataclasses.field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return len(self.decode) * self.num_decode_steps + sum(c.length for c in self.prefill)

    @property
    def has_work(self) -> bool:
        return bool(self.decode or self.prefill)

    @property
    def changes_slots(self) -> bool:
        """The plan changes the runner's slot state (a slot released, moved or filled, pages
        given): it must reach the runner even with no step to run, or a released slot would stay
        active on the device and decode into pages since given to another request."""
        return bool(
            self.released or self.moves or self.inserted or self.page_updates or self.lora_loads
        )
