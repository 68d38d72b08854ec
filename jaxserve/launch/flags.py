"""The engine flags shared by every launcher (generate, bench, convert), defined once here.

Importing this module defines the flags on absl's global FLAGS; a launcher then builds its engine
with `LLM(**llm_kwargs())` or `engine_config()`. A flag left unset is not passed on, so the engine's
own default applies (the help text says which). Every launcher accepts `--flagfile=FILE`.
"""

from __future__ import annotations

import re
from typing import Any

from absl import flags

from jaxserve.config import ATTENTION_IMPLS, DTYPES, KV_CACHE_DTYPES, EngineConfig

FLAGS = flags.FLAGS
_DEFAULTS = EngineConfig()

flags.DEFINE_string(
    "model",
    None,
    "Model to serve: unset = SmolLM2-135M-Instruct (the default GGUF); a Hugging Face directory "
    "(config.json + *.safetensors); a .gguf file; a converted checkpoint directory "
    "(checkpoints/<name>/); or a preset name (tiny, smollm2-135m, llama3.2-1b, ...) with "
    "--load_format=dummy.",
)
flags.DEFINE_enum(
    "load_format",
    "auto",
    ["auto", "dummy"],
    "auto: read the weights from --model; dummy: random weights with --model's preset shapes.",
)
flags.DEFINE_enum(
    "dtype", None, list(DTYPES), "Weight/activation dtype. Unset: the engine's default."
)
flags.DEFINE_string(
    "quantization",
    None,
    "Weight quantization applied at load time (e.g. int4, int8, fp8). Unset: weights as stored.",
)
flags.DEFINE_enum(
    "kv_cache_dtype",
    None,
    list(KV_CACHE_DTYPES),
    f"KV cache storage dtype; auto = the model dtype. Unset: {_DEFAULTS.kv_cache_dtype}.",
)
flags.DEFINE_integer(
    "num_slots",
    None,
    f"Requests decoded concurrently (batch slots). Unset: {_DEFAULTS.num_slots}.",
    lower_bound=1,
)
flags.DEFINE_integer(
    "max_model_len",
    None,
    f"Longest sequence (prompt + output tokens); longer prompts are rejected per request. "
    f"Unset: {_DEFAULTS.max_model_len}.",
    lower_bound=1,
)
flags.DEFINE_integer(
    "page_size",
    None,
    f"Tokens per KV cache page (a power of two). Unset: {_DEFAULTS.page_size}.",
    lower_bound=1,
)
flags.DEFINE_integer(
    "num_pages",
    None,
    "KV cache pages in the pool. Unset: from --kv_cache_memory, else enough for every slot to "
    "reach --max_model_len.",
    lower_bound=1,
)
flags.DEFINE_string(
    "kv_cache_memory",
    None,
    "KV cache size in bytes, e.g. 8GiB, 512MiB, 2e9 (used when --num_pages is unset).",
)
flags.DEFINE_enum(
    "attention_impl",
    None,
    list(ATTENTION_IMPLS),
    "Attention: auto = Pallas kernels on GPU, ragged elsewhere (XLA decode over the live pages); "
    "reference = the jnp gather reference; pallas_interpret runs the kernels in interpret mode "
    f"(CPU). Unset: {_DEFAULTS.attention_impl}.",
)
flags.DEFINE_integer(
    "seed",
    None,
    "Base random seed: dummy weights, and the seed requests without their own are derived from. "
    "Unset: the engine's default.",
)
flags.DEFINE_integer(
    "decode_steps",
    None,
    "Decode steps per host round trip (lax.scan on the device; new requests are admitted between "
    f"round trips). Unset: {_DEFAULTS.decode_steps}.",
)
flags.DEFINE_bool(
    "enable_prefix_caching",
    None,
    "Reuse the cached KV pages of identical token prefixes (shared system prompts, the n samples "
    f"of one prompt) instead of recomputing them. Unset: {_DEFAULTS.enable_prefix_caching}.",
)
flags.DEFINE_string(
    "slot_buckets",
    None,
    "Decode row buckets: 'auto' (powers of two from 8 up to --num_slots on CPU, one bucket of "
    "all slots on GPU) or comma-separated increasing sizes ending at --num_slots, e.g. 32 (every "
    f"decode step computes all slots) or 8,16,32. Unset: {_DEFAULTS.slot_buckets}.",
)
flags.DEFINE_bool(
    "fuse_prefill",
    None,
    "Run a step's decode rows and a lone prefill chunk (of a prompt's first two) in one forward "
    f"pass. Unset: {_DEFAULTS.fuse_prefill}.",
)

ENGINE_CONFIG_FLAGS = (
    "num_slots",
    "max_model_len",
    "page_size",
    "num_pages",
    "kv_cache_memory",
    "dtype",
    "kv_cache_dtype",
    "attention_impl",
    "decode_steps",
    "enable_prefix_caching",
    "slot_buckets",
    "fuse_prefill",
)
LLM_FLAGS = ("model", "load_format", "quantization", "seed") + ENGINE_CONFIG_FLAGS

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


def _value(name: str, fv: flags.FlagValues) -> Any:
    value = fv[name].value
    if name == "kv_cache_memory" and value is not None:
        return parse_bytes(value)
    if name == "slot_buckets" and value is not None and value != "auto":
        try:
            return tuple(int(x) for x in value.split(","))
        except ValueError:
            raise ValueError(
                f"--slot_buckets: expected 'auto' or comma-separated ints, got {value!r}"
            ) from None
    return value


def llm_kwargs(fv: flags.FlagValues = FLAGS) -> dict[str, Any]:
    """`LLM(**llm_kwargs())`: the engine flags that were set (model always, None = SmolLM2)."""
    kwargs = {name: _value(name, fv) for name in LLM_FLAGS}
    return {k: v for k, v in kwargs.items() if v is not None or k == "model"}


def engine_config(fv: flags.FlagValues = FLAGS) -> EngineConfig:
    """An EngineConfig from the engine flags that were set (the rest keep EngineConfig defaults)."""
    kwargs = {name: _value(name, fv) for name in ENGINE_CONFIG_FLAGS}
    return EngineConfig(**{k: v for k, v in kwargs.items() if v is not None})
