"""The device's adapter slots: which adapter each of the `max_loras` slots holds. Host only.

vLLM's LoRA manager, reduced to what a fixed-shape engine needs. The device keeps every slot's
weights in stacked arrays (`layers/lora.py`), so adapters come and go without a recompile:

    read(request)      the adapter, read and checked once (`peft.read_adapter`); the last
                       max_cpu_loras adapters no request holds stay cached on the host
    acquire(adapter)   a slot holding it for one more request: the slot that already holds it, else
                       a free slot, else the least recently used slot no admitted request holds
                       (its adapter is evicted); the load goes to `take_loads` for the runner. None
                       when every slot is held by other adapters' requests (the request waits).
    release(slot)      one request leaves the slot (finished or preempted)
    take_loads()       [(slot, adapter)] loaded since the last call, for the next plan

A request's row names its slot (`SlotState.lora`, -1 = no adapter).
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from jaxserve.lora.peft import LoRAAdapter
from jaxserve.lora.request import LoRARequest


class LoRASlots:
    def __init__(
        self,
        max_loras: int,
        max_cpu_loras: int,
        reader: Callable[[LoRARequest], LoRAAdapter],
    ):
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.reader = reader
        self.held: list[LoRAAdapter | None] = [None] * max_loras  # slot -> adapter
        self.pins = [0] * max_loras  # admitted requests using the slot
        self.last_used = [0] * max_loras
        self.clock = 0
        self.cache: collections.OrderedDict[int, LoRAAdapter] = collections.OrderedDict()
        self._loads: list[tuple[int, LoRAAdapter]] = []
        self.num_loads = 0

    def read(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter `request` names (cached by lora_int_id); ValueError naming what is wrong.
        One id names one adapter for the engine's lifetime, as in vLLM."""
        known = self.cache.get(request.lora_int_id) or next(
            (a for a in self.held if a is not None and a.lora_int_id == request.lora_int_id), None
        )
        if known is not None:
            if (known.request.lora_name, known.request.lora_path) != (
                request.lora_name,
                request.lora_path,
            ):
                raise ValueError(
                    f"lora_int_id {request.lora_int_id} already names adapter "
                    f"{known.request.lora_name!r} ({known.request.lora_path}); give "
                    f"{request.lora_name!r} ({request.lora_path}) another id"
                )
            self._remember(known)
            return known
        adapter = self.reader(request)
        self._remember(adapter)
        return adapter

    def _remember(self, adapter: LoRAAdapter) -> None:
        self.cache[adapter.lora_int_id] = adapter
        self.cache.move_to_end(adapter.lora_int_id)
        while len(self.cache) > self.max_cpu_loras:
            self.cache.popitem(last=False)

    def slot_of(self, lora_int_id: int) -> int | None:
        return next(
            (s for s, a in enumerate(self.held) if a is not None and a.lora_int_id == lora_int_id),
            None,
        )

    def acquire(self, adapter: LoRAAdapter) -> int | None:
        """A slot holding `adapter`, pinned for one request; None when none can be had now."""
        self.clock += 1
        slot = self.slot_of(adapter.lora_int_id)
        if slot is None:
            free = [s for s, a in enumerate(self.held) if a is None]
            idle = [s for s, a in enumerate(self.held) if a is not None and self.pins[s] == 0]
            if free:
                slot = free[0]
            elif idle:
                slot = min(idle, key=lambda s: self.last_used[s])  # the least recently used
            else:
                return None
            self.held[slot] = adapter
            self._loads = [(s, a) for s, a in self._loads if s != slot]
            self._loads.append((slot, adapter))
            self.num_loads += 1
        self.pins[slot] += 1
        self.last_used[slot] = self.clock
        return slot

    def release(self, slot: int) -> None:
        if self.pins[slot] <= 0:
            raise RuntimeError(f"LoRA slot {slot} released more often than acquired")
        self.pins[slot] -= 1

    def take_loads(self) -> list[tuple[int, LoRAAdapter]]:
        loads, self._loads = self._loads, []
        return loads
