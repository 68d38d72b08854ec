"""`LoRARequest`: which adapter a prompt runs with (vLLM's `vllm.lora.request.LoRARequest`)."""

from __future__ import annotations

import dataclasses
import json


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """An adapter, named as vLLM names it: `LoRARequest("sql", 1, "/path/to/adapter")`.

    lora_name: the adapter's name (what the server's `model` field selects);
    lora_int_id: a positive int unique to the adapter for the engine's lifetime (the key its
      device slot and prefix-cache pages are kept under);
    lora_path: a PEFT adapter folder (`adapter_config.json` + `adapter_model.safetensors`).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(
                f"LoRARequest.lora_name must be a non-empty str, got {self.lora_name!r}"
            )
        if (
            not isinstance(self.lora_int_id, int)
            or isinstance(self.lora_int_id, bool)
            or self.lora_int_id < 1
        ):
            raise ValueError(
                f"LoRARequest.lora_int_id must be an int >= 1 (vLLM's rule), got {self.lora_int_id!r}"
            )
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(
                f"LoRARequest {self.lora_name!r}: lora_path must name a PEFT adapter folder, "
                f"got {self.lora_path!r}"
            )

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


def parse_lora_modules(values: list[str]) -> dict[str, str]:
    """--lora_modules values -> {name: path}; ValueError naming a malformed one."""
    out = {}
    items = [v.strip() for v in values]
    for value in [v for item in items for v in ([item] if item.startswith("{") else item.split())]:
        if value.startswith("{"):
            try:
                d = json.loads(value)
                name, path = d["name"], d["path"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(
                    f"--lora_modules {value!r}: not a JSON name/path object ({e})"
                ) from None
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora_modules {value!r}: expected name=path")
        if name in out:
            raise ValueError(f"--lora_modules names {name!r} twice")
        out[name] = path
    return out


def lora_requests(modules: dict[str, str]) -> dict[str, LoRARequest]:
    """{name: LoRARequest} of named adapter folders, ids 1, 2, ... in their order."""
    return {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(modules.items())}
