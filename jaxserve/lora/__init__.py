"""LoRA adapters served many at once over one base model (vLLM's multi-LoRA). Host only.

    request.py   LoRARequest(lora_name, lora_int_id, lora_path): what a caller names per prompt
    peft.py      a PEFT adapter folder -> LoRAAdapter (numpy, checked against the model)
    slots.py     the device's adapter slots: which adapter each holds, LRU eviction, pins

The device side (the adapters' stacked weights and the per-row products) is `layers/lora.py`.
"""

from jaxserve.lora.request import LoRARequest

__all__ = ["LoRARequest"]
