"""The adapter slot table: reuse, LRU eviction of unheld slots only, pins, one id per adapter."""

import numpy as np
import pytest

from jaxserve.lora import LoRARequest
from jaxserve.lora.peft import LoRAAdapter
from jaxserve.lora.slots import LoRASlots


def adapter(i: int) -> LoRAAdapter:
    w = {"wq": (np.zeros((1, 2, 1), np.float32), np.zeros((1, 1, 2), np.float32))}
    return LoRAAdapter(LoRARequest(f"a{i}", i, f"/p{i}"), 1, 1.0, w)


def slots(max_loras=2, max_cpu_loras=3):
    reads = []

    def reader(req):
        reads.append(req.lora_int_id)
        return adapter(req.lora_int_id)

    return LoRASlots(max_loras, max_cpu_loras, reader), reads


def test_an_adapter_is_read_once_and_loaded_once_while_held():
    s, reads = slots()
    a = s.read(LoRARequest("a1", 1, "/p1"))
    assert s.read(LoRARequest("a1", 1, "/p1")) is a and reads == [1]
    assert s.acquire(a) == 0 and s.acquire(a) == 0
    assert [(slot, x.lora_int_id) for slot, x in s.take_loads()] == [(0, 1)]
    assert s.take_loads() == [] and s.pins == [2, 0]


def test_lru_eviction_never_takes_a_held_slot():
    s, _ = slots()
    a1, a2, a3 = (s.read(LoRARequest(f"a{i}", i, f"/p{i}")) for i in (1, 2, 3))
    assert s.acquire(a1) == 0 and s.acquire(a2) == 1
    assert s.acquire(a3) is None  # both slots held: the request waits
    s.release(1)
    assert s.acquire(a3) == 1  # a2's slot, no longer held, is evicted
    s.release(0)
    s.release(1)
    s.acquire(a1)  # a1 used last: a3's slot is the least recently used
    s.release(0)
    assert s.acquire(a2) == 1
    assert [(slot, x.lora_int_id) for slot, x in s.take_loads()] == [(0, 1), (1, 2)]
    with pytest.raises(RuntimeError, match="released more often"):
        s.release(0)
        s.release(0)


def test_one_id_names_one_adapter():
    s, _ = slots()
    s.read(LoRARequest("a1", 1, "/p1"))
    with pytest.raises(ValueError, match=r"lora_int_id 1 already names adapter 'a1' \(/p1\)"):
        s.read(LoRARequest("other", 1, "/elsewhere"))


def test_the_host_cache_keeps_the_last_max_cpu_loras():
    s, reads = slots(max_cpu_loras=2)
    for i in (1, 2, 3, 1):
        s.read(LoRARequest(f"a{i}", i, f"/p{i}"))
    assert reads == [1, 2, 3, 1] and list(s.cache) == [3, 1]
