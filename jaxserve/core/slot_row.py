"""A request's sampling parameters as the fixed-size numpy row of one decode slot.

    make_slot_row(sp, prompt_ids, output_ids, eos_ids, seed, max_model_len) -> SlotRow (numpy)
      -> runner: sampling.set_slot(state, slot, row)         one slot of the device SamplingState
    seed_key_data(seed)                                      the threefry key data of a seed

Host side only (numpy, never jax). The row's sizes are the per-slot bounds of
`core/sampling_fields.py` (MAX_STOP_IDS, MAX_LOGIT_BIAS, MAX_ALLOWED_TOKEN_IDS, MAX_BAD_WORDS x
MAX_BAD_WORD_TOKENS), so every row has the same shapes and inserting one compiles nothing new.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxserve.core.sampling_fields import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_STOP_IDS,
    is_int,
)
from jaxserve.core.sampling_params import SamplingParams

_F32_MAX = float(np.finfo(np.float32).max)  # a finite value past it saturates there

_U32 = 0xFFFFFFFF


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
    bias_ids: np.ndarray  # i32[MAX_LOGIT_BIAS]; logit_bias token ids, -1 padded
    bias_values: np.ndarray  # f32[MAX_LOGIT_BIAS]; their biases (0 where padded)
    allowed_ids: np.ndarray  # i32[MAX_ALLOWED_TOKEN_IDS]; -1 padded; all -1 = every token allowed
    bad_words: np.ndarray  # i32[MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS]; right-aligned, -1 padded
    recent_tokens: np.ndarray  # i32[MAX_BAD_WORD_TOKENS - 1]; last outputs, newest last, -2 padded


def seed_key_data(seed: int) -> np.ndarray:
    """u32[2] threefry key data for `seed`: [high, low] 32 bits of its 64-bit two's complement.

    Equals `jax.random.key_data(jax.random.key(seed))` for 0 <= seed < 2**32 (and for every int64
    seed with jax_enable_x64), so a request's key is a function of its seed alone.
    """
    if not is_int(seed) or not (-(2**63) <= seed < 2**64):
        raise ValueError(f"seed must be an int in [-2**63, 2**64), got {seed!r}")
    seed = int(seed)
    return np.array([(seed >> 32) & _U32, seed & _U32], dtype=np.uint32)


def _padded(name: str, ids: Any, length: int) -> np.ndarray:
    ids = list(ids)
    if len(ids) > length:
        raise ValueError(f"{name} has {len(ids)} tokens, more than {length}")
    if not all(is_int(t) and t >= 0 for t in ids):
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
    Stop ids (eos, even with `ignore_eos` as in vLLM, plus `stop_token_ids`) are written only when
    min_tokens > 0: they are only used to suppress stopping before min_tokens tokens. bad_words
    need their token ids (`sp.with_bad_words_ids(tokenizer)`, which the engine does).
    """
    if not isinstance(sp, SamplingParams):
        raise ValueError(f"sp must be a SamplingParams, got {type(sp).__name__}")
    if not is_int(max_model_len) or max_model_len < 1:
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
        # vLLM's all_stop_token_ids: eos is suppressed during min_tokens even with ignore_eos.
        stop = list(dict.fromkeys([*eos_token_ids, *(sp.stop_token_ids or ())]))
        if len(stop) > MAX_STOP_IDS:
            raise ValueError(
                f"stop_token_ids: {len(stop)} distinct stop/eos ids with min_tokens > 0, "
                f"at most {MAX_STOP_IDS} are supported"
            )
    if sp.bad_words and sp.bad_words_token_ids is None:
        raise ValueError("bad_words must be tokenized first (SamplingParams.with_bad_words_ids)")
    bad_words = np.full((MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS), -1, np.int32)
    for i, seq in enumerate(sp.bad_words_token_ids or ()):
        bad_words[i, MAX_BAD_WORD_TOKENS - len(seq) :] = seq
    recent = np.full((MAX_BAD_WORD_TOKENS - 1,), -2, np.int32)
    tail = list(output_token_ids)[-(MAX_BAD_WORD_TOKENS - 1) :]
    if tail:
        recent[len(recent) - len(tail) :] = tail
    bias = sp.logit_bias or {}
    bias_values = np.zeros((MAX_LOGIT_BIAS,), np.float32)
    bias_values[: len(bias)] = np.clip(list(bias.values()), -_F32_MAX, _F32_MAX)
    greedy = sp.greedy
    # saturating: a value past f32's range (repetition_penalty=1e308 is valid) is f32's largest
    f32 = lambda x: np.array(np.clip(x, -_F32_MAX, _F32_MAX), dtype=np.float32)
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
        bias_ids=_padded("logit_bias", list(bias), MAX_LOGIT_BIAS),
        bias_values=bias_values,
        allowed_ids=_padded("allowed_token_ids", sp.allowed_token_ids or (), MAX_ALLOWED_TOKEN_IDS),
        bad_words=bad_words,
        recent_tokens=recent,
    )
