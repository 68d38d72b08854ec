"""Per-request sampling parameters (vLLM's names and defaults) and their per-slot numpy row.

Host side only: this module never imports jax. Dataflow:

    SamplingParams(**kw) / SamplingParams.from_dict(d)    validated, frozen
      -> make_slot_row(sp, prompt_ids, output_ids, eos_ids, seed, max_model_len) -> SlotRow (numpy)
      -> runner: sampling.set_slot(state, slot, row)         one slot of the device SamplingState

Every bad value raises `ValueError` naming the field. A temperature below `SAMPLING_EPS` means
greedy (as in vLLM); a greedy row switches top-k/top-p/min-p off so it never asks for the sort path.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any

import numpy as np

MAX_LOGPROBS = 20  # most top-n logprobs per token (generated or prompt)
MAX_N = 128  # most samples per request (OpenAI's limit for `n`)
MAX_INT32 = 2**31 - 1  # token counts and ids live in int32 arrays on the device
MAX_STOP_IDS = 16  # stop/eos ids per slot suppressed while fewer than min_tokens were generated
SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)
_U32 = 0xFFFFFFFF


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool | np.bool_)


def _is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool | np.bool_)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample one request's continuation (vLLM `SamplingParams` names and defaults).

    top_k: 0 or -1 switch it off. stop: str or list of str (normalized to a tuple).
    logprobs / prompt_logprobs: top-n log-probs per generated / prompt token (n <= MAX_LOGPROBS).
    seed: None lets the engine draw one at submission; any int in [-2**63, 2**64).
    Keyword arguments only; an unknown or invalid one raises ValueError naming it.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: str | tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            set_(name, _real(name, getattr(self, name)))
        for name in ("presence_penalty", "frequency_penalty"):
            set_(name, _real(name, getattr(self, name)))
        for name in ("n", "top_k", "max_tokens", "min_tokens"):
            set_(name, _int(name, getattr(self, name)))
        for name in ("seed", "logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                set_(name, _int(name, getattr(self, name)))
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        set_("stop", _stop_strings(self.stop))
        set_("stop_token_ids", _stop_ids(self.stop_token_ids))

        if not (1 <= self.n <= MAX_N):
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        for name in ("top_k", "max_tokens", "min_tokens"):
            if getattr(self, name) > MAX_INT32:
                raise ValueError(f"{name} must be at most 2**31 - 1, got {getattr(self, name)}")
        if not (0.0 <= self.temperature < math.inf):
            raise ValueError(f"temperature must be finite and non-negative, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disable), or at least 1, got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not (-(2**63) <= self.seed < 2**64):
            raise ValueError(f"seed must be in [-2**63, 2**64), got {self.seed}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not (0 <= self.min_tokens <= self.max_tokens):
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if not (0.0 < self.repetition_penalty < math.inf):
            raise ValueError(
                f"repetition_penalty must be positive and finite, got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not (-2.0 <= getattr(self, name) <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """Builds from a JSON-like dict; an unknown key raises ValueError naming it."""
        if not isinstance(d, dict):
            raise ValueError(f"sampling parameters must be a dict, got {type(d).__name__}")
        return cls(**d)

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature 0, or below SAMPLING_EPS as in vLLM)."""
        return self.temperature < SAMPLING_EPS


_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
_dataclass_init = SamplingParams.__init__


@functools.wraps(_dataclass_init)
def _init(self, *args, **kwargs):
    # The generated __init__ raises TypeError for an unknown keyword; the API promises ValueError.
    if args:
        raise ValueError("SamplingParams takes keyword arguments only")
    for key in kwargs:
        if key not in _FIELDS:
            raise ValueError(f"unknown sampling parameter {key!r}")
    _dataclass_init(self, **kwargs)


SamplingParams.__init__ = _init


def _real(name: str, value: Any) -> float:
    if not _is_real(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        return float(value)
    except OverflowError:  # an int beyond float range, e.g. 10**400
        raise ValueError(f"{name} is too large to be a float: {str(value)[:20]}...") from None


def _int(name: str, value: Any) -> int:
    if not _is_int(value):
        raise ValueError(f"{name} must be an int, got {value!r}")
    return int(value)


def _stop_strings(stop: Any) -> tuple[str, ...] | None:
    if stop is None:
        return None
    items = (stop,) if isinstance(stop, str) else stop
    if not isinstance(items, list | tuple) or not all(isinstance(s, str) for s in items):
        raise ValueError(f"stop must be a str or a list of str, got {stop!r}")
    if any(s == "" for s in items):
        raise ValueError("stop cannot contain an empty string")
    return tuple(items)


def _stop_ids(ids: Any) -> tuple[int, ...] | None:
    if ids is None:
        return None
    if not isinstance(ids, list | tuple) or not all(
        _is_int(t) and 0 <= t <= MAX_INT32 for t in ids
    ):
        raise ValueError(
            f"stop_token_ids must be a list of ints in [0, 2**31 - 1], got {str(ids)[:200]}"
        )
    return tuple(int(t) for t in ids)


@dataclasses.dataclass
class SlotRow:
    """One request's sampling state as numpy arrays for `sampling.set_slot` (L = max_model_len).

    `sampling.py` registers this class as a jax pytree, so it can be passed to jit as is.
    """

    temperature: np.ndarray  # f32[]; 0 = greedy
    top_k: np.ndarray  # i32[]; 0 = off
    top_p: np.ndarray  # f32[]; 1 = off
    min_p: np.ndarray  # f32[]; 0 = off
    repetition_penalty: np.ndarray  # f32[]; 1 = off
    presence_penalty: np.ndarray  # f32[]
    frequency_penalty: np.ndarray  # f32[]
    min_tokens: np.ndarray  # i32[]
    key_data: np.ndarray  # u32[2]; jax.random.key_data(jax.random.key(seed)) (threefry2x32)
    prompt_tokens: np.ndarray  # i32[L]; -1 padded
    output_tokens: np.ndarray  # i32[L]; tokens generated so far (before a preemption); -1 padded
    stop_ids: np.ndarray  # i32[MAX_STOP_IDS]; -1 padded; only used while < min_tokens generated


def seed_key_data(seed: int) -> np.ndarray:
    """u32[2] threefry key data for `seed`: [high, low] 32 bits of its 64-bit two's complement.

    Equals `jax.random.key_data(jax.random.key(seed))` for 0 <= seed < 2**32 (and for every int64
    seed with jax_enable_x64), so a request's key is a function of its seed alone.
    """
    if not _is_int(seed) or not (-(2**63) <= seed < 2**64):
        raise ValueError(f"seed must be an int in [-2**63, 2**64), got {seed!r}")
    seed = int(seed)
    return np.array([(seed >> 32) & _U32, seed & _U32], dtype=np.uint32)


def _padded(name: str, ids: Any, length: int) -> np.ndarray:
    ids = list(ids)
    if len(ids) > length:
        raise ValueError(f"{name} has {len(ids)} tokens, more than {length}")
    if not all(_is_int(t) and t >= 0 for t in ids):
        raise ValueError(f"{name} must hold non-negative int token ids")
    out = np.full((length,), -1, dtype=np.int32)
    out[: len(ids)] = ids
    return out


def make_slot_row(
    sp: SamplingParams,
    prompt_token_ids: list[int],
    output_token_ids: list[int],
    eos_token_ids: tuple[int, ...],
    seed: int,
    max_model_len: int,
) -> SlotRow:
    """Turns one request into its per-slot row. `seed` is the request's concrete seed (an int).

    Greedy rows (temperature < SAMPLING_EPS) get temperature 0 and top-k/top-p/min-p off.
    Stop ids (eos unless `ignore_eos`, plus `stop_token_ids`) are written only when min_tokens > 0:
    they are only used to suppress stopping before min_tokens tokens.
    """
    if not isinstance(sp, SamplingParams):
        raise ValueError(f"sp must be a SamplingParams, got {type(sp).__name__}")
    if not _is_int(max_model_len) or max_model_len < 1:
        raise ValueError(f"max_model_len must be a positive int, got {max_model_len!r}")
    prompt = _padded("prompt_token_ids", prompt_token_ids, max_model_len)
    output = _padded("output_token_ids", output_token_ids, max_model_len)
    if len(prompt_token_ids) + len(output_token_ids) > max_model_len:
        raise ValueError(
            f"prompt_token_ids + output_token_ids ({len(prompt_token_ids)} + "
            f"{len(output_token_ids)}) exceed max_model_len={max_model_len}"
        )
    stop = []
    if sp.min_tokens > 0:
        candidates = (() if sp.ignore_eos else tuple(eos_token_ids)) + (sp.stop_token_ids or ())
        stop = list(dict.fromkeys(candidates))
        if len(stop) > MAX_STOP_IDS:
            raise ValueError(
                f"stop_token_ids: {len(stop)} distinct stop/eos ids with min_tokens > 0, "
                f"at most {MAX_STOP_IDS} are supported"
            )
    greedy = sp.greedy
    f32 = lambda x: np.array(x, dtype=np.float32)
    i32 = lambda x: np.array(x, dtype=np.int32)
    return SlotRow(
        temperature=f32(0.0 if greedy else sp.temperature),
        top_k=i32(0 if greedy else max(sp.top_k, 0)),
        top_p=f32(1.0 if greedy else sp.top_p),
        min_p=f32(0.0 if greedy else sp.min_p),
        repetition_penalty=f32(sp.repetition_penalty),
        presence_penalty=f32(sp.presence_penalty),
        frequency_penalty=f32(sp.frequency_penalty),
        min_tokens=i32(sp.min_tokens),
        key_data=seed_key_data(seed),
        prompt_tokens=prompt,
        output_tokens=output,
        stop_ids=_padded("stop_token_ids", stop, MAX_STOP_IDS),
    )
