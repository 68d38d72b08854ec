"""Each sampling field's parser, and the bounds of the per-slot arrays the fields become.

Host only (no jax). `SamplingParams.__post_init__` runs every raw value through one of these; each
returns the field's normal form or raises `ValueError` naming the field:

    parse_float / parse_int     a real / an integral number (bool is neither), as float / int
    parse_stop                  str | list[str] -> list[str] ([] unset); no empty string
    parse_token_ids             list of ids in [0, 2**31 - 1] -> de-duplicated in order (vLLM)
    parse_logit_bias            {id or int string: finite bias} -> {int: float}, <= MAX_LOGIT_BIAS
    parse_bad_words             str | list[str] -> de-duplicated list[str] ([] unset)
    tokenize_bad_words          bad_words -> token sequences with the engine's tokenizer (vLLM's
                                `update_from_tokenizer`), <= MAX_BAD_WORDS x MAX_BAD_WORD_TOKENS

The MAX_* bounds are the fixed shapes of a slot's sampling arrays (`core/slot_row.py` on the host,
`runner/sampling.py` on the device), so every slot row has the same shapes.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

MAX_INT32 = 2**31 - 1  # token counts and ids live in int32 arrays on the device
MAX_STOP_IDS = 16  # stop/eos ids per slot suppressed while fewer than min_tokens were generated
MAX_LOGIT_BIAS = 256  # logit_bias entries per request (a per-slot array on the device)
MAX_ALLOWED_TOKEN_IDS = 1024  # allowed_token_ids per request (a per-slot array on the device)
MAX_BAD_WORDS = 16  # token sequences of bad_words per request, after tokenization
MAX_BAD_WORD_TOKENS = 8  # tokens of one bad word


def is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool | np.bool_)


def is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool | np.bool_)


def parse_float(name: str, value: Any) -> float:
    if not is_real(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        return float(value)
    except OverflowError:  # an int beyond float range, e.g. 10**400
        raise ValueError(f"{name} is too large to be a float: {str(value)[:20]}...") from None


def parse_int(name: str, value: Any) -> int:
    if not is_int(value):
        raise ValueError(f"{name} must be an int, got {value!r}")
    return int(value)


def parse_stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    items = (stop,) if isinstance(stop, str) else stop
    if not isinstance(items, list | tuple) or not all(isinstance(s, str) for s in items):
        raise ValueError(f"stop must be a str or a list of str, got {stop!r}")
    if any(s == "" for s in items):
        raise ValueError("stop cannot contain an empty string")
    return list(items)


def parse_token_ids(name: str, ids: Any) -> list[int] | None:
    """A list of token ids, de-duplicated in order (vLLM's dict.fromkeys)."""
    if ids is None:
        return None
    if not isinstance(ids, list | tuple) or not all(is_int(t) and 0 <= t <= MAX_INT32 for t in ids):
        raise ValueError(f"{name} must be a list of ints in [0, 2**31 - 1], got {str(ids)[:200]}")
    return list(dict.fromkeys(int(t) for t in ids))


def parse_logit_bias(bias: Any) -> dict[int, float] | None:
    """{token id: bias}; keys may be int strings (JSON), biases finite numbers."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {str(bias)[:200]}")
    if len(bias) > MAX_LOGIT_BIAS:
        raise ValueError(
            f"logit_bias has {len(bias)} entries, at most {MAX_LOGIT_BIAS} are supported"
        )
    out = {}
    for key, value in bias.items():
        try:
            tid = int(key) if isinstance(key, str) else key
        except ValueError:
            tid = None
        if not is_int(tid) or not 0 <= tid <= MAX_INT32:
            raise ValueError(f"logit_bias keys must be token ids (ints), got {str(key)[:50]!r}")
        value = parse_float("logit_bias", value)
        if not math.isfinite(value):
            raise ValueError(f"logit_bias values must be finite, got {value} for token {tid}")
        out[int(tid)] = value
    return out


def parse_bad_words(words: Any) -> list[str]:
    if words is None:
        return []
    items = (words,) if isinstance(words, str) else words
    if not isinstance(items, list | tuple) or not all(isinstance(w, str) for w in items):
        raise ValueError(f"bad_words must be a list of str, got {str(words)[:200]}")
    if any(not w for w in items):
        raise ValueError("bad_words cannot contain an empty string")
    return list(dict.fromkeys(items))


def tokenize_bad_words(bad_words: list[str], tokenizer) -> tuple[tuple[int, ...], ...] | None:
    """vLLM's `update_from_tokenizer`: each word without, then with, a leading space."""
    if not bad_words:
        return None
    if tokenizer is None:
        raise ValueError("bad_words need a tokenizer; this model has none")
    seqs: list[tuple[int, ...]] = []
    for word in bad_words:
        for prefix in ("", " "):
            ids = tuple(tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False))
            if not ids:
                if not prefix:
                    raise ValueError(f"bad_words entry {word!r} tokenizes to no tokens")
                continue
            # The spaced form counts when it is a new word token of the same length (vLLM).
            if not prefix or (ids[0] != seqs[-1][0] and len(ids) == len(seqs[-1])):
                seqs.append(ids)
    if len(seqs) > MAX_BAD_WORDS:
        raise ValueError(
            f"bad_words: {len(seqs)} token sequences after tokenization, at most "
            f"{MAX_BAD_WORDS} are supported"
        )
    longest = max(len(q) for q in seqs)
    if longest > MAX_BAD_WORD_TOKENS:
        raise ValueError(
            f"bad_words: a word of {longest} tokens, at most {MAX_BAD_WORD_TOKENS} are supported"
        )
    return tuple(seqs)
