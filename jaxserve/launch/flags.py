"""The engine flags of every launcher (generate, bench, convert): one per `EngineConfig` field.

Importing this module defines, on absl's global FLAGS, a flag for each field of `EngineConfig`,
named like the field, with the field's help text (which says its default) and a type from its
annotation: bool, int, str, an enum for a field with fixed choices, and three parsed strings,
`--kv_cache_memory=8GiB` (bytes), `--slot_buckets=auto|8,16,32` and
`--num_speculative_tokens_per_batch_size='[[1, 8, 3], [9, 32, 1]]'` (JSON). Every flag defaults
to None: a flag left unset is not passed on, so the engine's own default applies.
`--speculative_config` takes vLLM's JSON dict (`{"method": "ngram", "num_speculative_tokens": 3,
...}`) for the speculative fields it names. A launcher then builds its
engine with `LLM(**llm_kwargs())`, or takes `engine_config()`; both raise ValueError naming a bad
field. Every launcher accepts `--flagfile=FILE`.
"""

from __future__ import annotations

import dataclasses
import json
import re
import types
import typing
from typing import Any

from absl import flags

from jaxserve.config import EngineConfig
from jaxserve.config.speculative import merge_speculative_config, normalize_schedule
from jaxserve.launch import distributed  # noqa: F401  (every launcher takes the multi-host flags)
from jaxserve.lora.request import parse_lora_modules

FLAGS = flags.FLAGS

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'8GiB' -> 8589934592; '512MB' -> 512000000; '2e9' -> 2000000000. ValueError if malformed."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m and m.group(2).lower()
    if not m or unit not in _UNITS:
        raise ValueError(f"--kv_cache_memory: cannot read {text!r} as a size (e.g. 8GiB, 512MiB)")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"--kv_cache_memory must be positive, got {text!r}")
    return value


def parse_slot_buckets(text: str) -> tuple[int, ...] | str:
    """'auto' -> 'auto'; '8,16,32' -> (8, 16, 32). ValueError if malformed."""
    if text.strip() == "auto":
        return "auto"
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(
            f"--slot_buckets: expected 'auto' or comma-separated ints, got {text!r}"
        ) from None


class _Parser(flags.ArgumentParser):
    """A string flag whose value is `parse(text)` (a ValueError is absl's flag error)."""

    def __init__(self, parse, syntax: str):
        self._parse, self.syntax = parse, syntax

    def parse(self, argument):
        return self._parse(argument) if isinstance(argument, str) else argument

    def flag_type(self) -> str:
        return self.syntax


class _Serializer(flags.ArgumentSerializer):
    """Writes a parsed value back as flag text (`FLAGS.flags_into_string`, flagfiles)."""

    def serialize(self, value) -> str:
        return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


class _JsonSerializer(flags.ArgumentSerializer):
    def serialize(self, value) -> str:
        return json.dumps(value)


# The fields whose flag is text parsed into another type, and how each is written back.
_PARSERS = {
    "kv_cache_memory": (_Parser(parse_bytes, "bytes"), _Serializer()),
    "slot_buckets": (_Parser(parse_slot_buckets, "auto | comma-separated ints"), _Serializer()),
    "num_speculative_tokens_per_batch_size": (
        _Parser(normalize_schedule, "JSON list of [first, last, k]"),
        _JsonSerializer(),
    ),
}


def _base_type(annotation) -> Any:
    """`int | None` -> int; `str | ModelConfig | None` -> str (the flag names the model)."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return str if str in args else args[0]
    return annotation


def _define(field: dataclasses.Field, annotation) -> None:
    name, text = field.name, field.metadata["help"]
    base = _base_type(annotation)
    if name in _PARSERS:
        parser, serializer = _PARSERS[name]
        flags.DEFINE(parser, name, None, text, serializer=serializer)
    elif "choices" in field.metadata:
        flags.DEFINE_enum(name, None, list(field.metadata["choices"]), text)
    elif base is bool:
        flags.DEFINE_bool(name, None, text)
    elif base is int:
        flags.DEFINE_integer(name, None, text)
    elif base is str:
        flags.DEFINE_string(name, None, text)
    else:
        raise TypeError(f"no flag type for EngineConfig.{name}: {annotation}")


_HINTS = typing.get_type_hints(EngineConfig)
FLAG_NAMES = tuple(f.name for f in dataclasses.fields(EngineConfig))  # one flag per field
for _field in dataclasses.fields(EngineConfig):
    _define(_field, _HINTS[_field.name])
flags.DEFINE_string(
    "speculative_config",
    None,
    'vLLM\'s speculative_config as JSON, e.g. \'{"method": "ngram", '
    '"num_speculative_tokens": 3, "prompt_lookup_max": 4}\': sets the speculative fields it '
    "names (method 'ngram' only; a field set both here and by its own flag is an error).",
)


flags.DEFINE_multi_string(
    "lora_modules",
    [],
    "LoRA adapters served by name (needs --enable_lora), each name=path (a PEFT folder) or "
    'vLLM\'s JSON {"name": ..., "path": ...}: a server request selects one by its model field, '
    "a batch job's row by its lora field. "
    "Repeat the flag, or give several name=path space-separated.",
)


def lora_modules(fv: flags.FlagValues = FLAGS) -> dict[str, str]:
    """--lora_modules as {name: PEFT folder}; ValueError for a malformed value, or adapters
    without --enable_lora."""
    modules = parse_lora_modules(fv["lora_modules"].value or [])
    if modules and not fv["enable_lora"].value:
        raise ValueError("--lora_modules needs --enable_lora")
    return modules


def llm_kwargs(fv: flags.FlagValues = FLAGS) -> dict[str, Any]:
    """`LLM(**llm_kwargs())`: the engine flags that were set, checked by `EngineConfig`
    (ValueError naming a bad field); an unset flag is left out, so its default applies."""
    kwargs = {name: fv[name].value for name in FLAG_NAMES if fv[name].value is not None}
    spec = fv["speculative_config"].value
    kwargs = merge_speculative_config(kwargs, spec, "by its flag and in --speculative_config")
    EngineConfig(**kwargs)
    return kwargs


def engine_config(fv: flags.FlagValues = FLAGS) -> EngineConfig:
    """The EngineConfig of the engine flags that were set (unfilled: `for_model` fills it)."""
    return EngineConfig(**llm_kwargs(fv))
