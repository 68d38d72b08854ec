"""vLLM's spellings of speculative decoding: its `speculative_config` dict, and its batch-size
schedule of the drafts a row proposes (`num_speculative_tokens_per_batch_size`).

    speculative_settings({"method": "ngram", "num_speculative_tokens": 3, ...})
        -> {"num_speculative_tokens": 3, ...}          EngineConfig's fields (LLM and the flags)
    merge_speculative_config(settings, config, where)  those fields added to settings, each once
    checked_fields(engine_config)                    the speculative fields checked together, filled
    normalize_schedule([[1, 8, 3], [9, 32, 1]]) -> ((1, 8, 3), (9, 32, 1))    checked, sorted
    schedule_drafts(schedule, k, batch_size)         the drafts a row proposes at that batch size

jaxserve speculates by prompt lookup only (vLLM's method "ngram"); a dict naming another method or
a key jaxserve does not read is refused with a ValueError naming it, not ignored.
"""

from __future__ import annotations

import json
from typing import Any

# vLLM's speculative_config keys -> EngineConfig's fields ("disable_by_batch_size" is vLLM v0's)
_KEYS = {
    "num_speculative_tokens": "num_speculative_tokens",
    "prompt_lookup_max": "prompt_lookup_max",
    "prompt_lookup_min": "prompt_lookup_min",
    "num_speculative_tokens_per_batch_size": "num_speculative_tokens_per_batch_size",
    "disable_by_batch_size": "speculative_disable_by_batch_size",
}
_NGRAM = ("ngram", "[ngram]")  # method, or v0's model="[ngram]"


def speculative_settings(config: dict[str, Any] | str | None) -> dict[str, Any]:
    """EngineConfig's fields for vLLM's `speculative_config` (a dict, or its JSON text as
    `--speculative-config` takes it); {} for None. ValueError naming a bad key or method."""
    if config is None:
        return {}
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config: not JSON ({e}): {config!r}") from None
    if not isinstance(config, dict):
        raise ValueError(f"speculative_config must be a dict, got {type(config).__name__}")
    config = dict(config)
    method, model = config.pop("method", None), config.pop("model", None)
    if method not in _NGRAM and not (method is None and model in _NGRAM):
        raise ValueError(
            "speculative_config: jaxserve speculates by prompt lookup only (method 'ngram'), got "
            f"method={method!r}" + ("" if model is None else f", model={model!r}")
        )
    if model is not None and model not in _NGRAM:
        raise ValueError(f"speculative_config: no draft model with method 'ngram', got {model!r}")
    unknown = sorted(set(config) - set(_KEYS))
    if unknown:
        raise ValueError(
            f"speculative_config: unsupported key(s) {unknown}; jaxserve reads {['method', *_KEYS]}"
        )
    if "num_speculative_tokens" not in config:
        raise ValueError("speculative_config: num_speculative_tokens is required")
    return {_KEYS[k]: v for k, v in config.items()}


def merge_speculative_config(settings: dict, config, where: str) -> dict:
    """`settings` with the fields of vLLM's speculative_config added (`speculative_settings`);
    ValueError if one is in both ("<field> is set twice: <where>")."""
    out = dict(settings)
    for name, value in speculative_settings(config).items():
        if name in out:
            raise ValueError(f"{name} is set twice: {where}")
        out[name] = value
    return out


# The largest speculative settings an engine takes. Each speculative step verifies k + 1 tokens a
# row (a program per (bucket, k) pair at warm-up), and the n-gram proposer unrolls its
# prompt_lookup_max window comparisons while tracing: 10**9 never finished tracing, k = 4096 ran
# out of memory, 2**40 overflowed inside jax (issue 58). vLLM's ngram defaults are k 3-5, n <= 5.
MAX_SPECULATIVE_TOKENS = 32
MAX_PROMPT_LOOKUP = 32


def checked_fields(c) -> dict[str, Any]:
    """An EngineConfig's speculative fields checked against each other and filled (its
    __post_init__ sets them): the schedule normalized (it needs num_speculative_tokens > 0), and
    prompt_lookup_min / _max each defaulting to the other, both to 5 when neither is set (vLLM's
    defaults), min <= max. ValueError naming the field."""
    if c.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
        raise ValueError(
            f"EngineConfig.num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS} (each "
            f"speculative step verifies that many drafts a row), got {c.num_speculative_tokens}"
        )
    for name in ("prompt_lookup_min", "prompt_lookup_max"):
        value = getattr(c, name)
        if value is not None and value > MAX_PROMPT_LOOKUP:
            raise ValueError(
                f"EngineConfig.{name} must be at most {MAX_PROMPT_LOOKUP} (the proposer compares "
                f"that many tokens per n-gram), got {value}"
            )
    schedule = c.num_speculative_tokens_per_batch_size
    if schedule is not None:
        if not c.num_speculative_tokens:
            raise ValueError(
                "EngineConfig.num_speculative_tokens_per_batch_size needs "
                "num_speculative_tokens > 0 (the most drafts a row proposes)"
            )
        schedule = normalize_schedule(schedule)
    lo, hi = c.prompt_lookup_min, c.prompt_lookup_max
    lo, hi = (5, 5) if lo is None and hi is None else (lo or hi, hi or lo)
    if lo > hi:
        raise ValueError(
            f"EngineConfig.prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})"
        )
    return {
        "num_speculative_tokens_per_batch_size": schedule,
        "prompt_lookup_min": lo,
        "prompt_lookup_max": hi,
    }


def normalize_schedule(value: Any) -> tuple[tuple[int, int, int], ...]:
    """vLLM's `num_speculative_tokens_per_batch_size`: (first, last, k) entries, inclusive,
    positive, non-overlapping, the first starting at 1 (every batch size has a k), k >= 0; as
    a sorted tuple of int triples (JSON text as a flag gives it is read first). ValueError
    naming the problem."""
    name = "num_speculative_tokens_per_batch_size"
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(
                f"{name}: expected JSON like [[1, 8, 3], [9, 32, 1]], got {value!r}"
            ) from None
    if not isinstance(value, list | tuple) or not value:
        raise ValueError(f"{name} must be a non-empty list of (first, last, k) entries")
    out = []
    for entry in value:
        if (
            not isinstance(entry, list | tuple)
            or len(entry) != 3
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in entry)
        ):
            raise ValueError(f"{name}: each entry must be 3 ints (first, last, k), got {entry!r}")
        first, last, k = entry
        if first < 1 or last < first or k < 0:
            raise ValueError(f"{name}: entry {tuple(entry)} needs 1 <= first <= last and k >= 0")
        out.append((first, last, k))
    out.sort()
    if out[0][0] != 1:
        raise ValueError(f"{name}: the first range must start at batch size 1, got {out[0]}")
    for a, b in zip(out, out[1:], strict=False):
        if b[0] <= a[1]:
            raise ValueError(f"{name}: ranges {a} and {b} overlap")
    return tuple(out)


def schedule_drafts(schedule, k: int, batch_size: int) -> int:
    """Drafts a row proposes in a step of `batch_size` requests: the k of the range holding it,
    of the range before it in a gap, of the last range past the end (vLLM's dense lookup), never
    more than `k`; `k` without a schedule."""
    if schedule is None:
        return k
    drafts = schedule[0][2]
    for first, _, n in schedule:
        if first > batch_size:
            break
        drafts = n
    return min(drafts, k)
