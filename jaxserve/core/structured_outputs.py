"""Structured outputs: a request's output constrained to a JSON schema, a regex, a choice or a
grammar, with llguidance as the grammar engine (no torch).

    SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))     vLLM's names
    StructuredOutputManager(tokenizer, vocab_size)        one per engine (host only)
      .compile(params) -> Grammar                         ValueError naming the problem
      .sampling_rows(plan) -> {slot: Grammar}             a plan's constrained rows that sample
      .masks(rows, num_slots) -> GrammarMasks             their next-token masks, for the runner
      .fill_bitmask(grammars_by_row, num_rows) -> i32[num_rows, ceil(V / 32)]
    Grammar.accept(token) / .copy() / .is_terminated

The engine compiles a request's grammar when it is added (a bad schema or regex is that request's
error), computes the packed next-token bitmask of every constrained row that samples in a step
(llguidance's thread pool, rows in parallel), and advances each grammar by the token the row
sampled. The device applies the mask in the jitted sampler (`runner/sampling.py`): bit t of word
t // 32 of a row set means token t is allowed; unconstrained rows are not touched. Log-probs are
those of the masked distribution, as in vLLM (its grammar bitmask is applied to the logits before
the sampler computes them).

Choices, as in vLLM's llguidance backend (`v1/structured_output/backend_guidance.py`):
`json_object` is any JSON object; `disable_any_whitespace` turns llguidance's flexible whitespace
off; `disable_additional_properties` adds `additionalProperties: false` to every object schema
that does not set it; `grammar` is Lark or GBNF. `structural_tag` and `whitespace_pattern` are
refused (not supported by this backend). Once a grammar is complete only EOS is allowed, so the
request stops as any other does (finish_reason "stop", the EOS text left out).
"""

from __future__ import annotations

import dataclasses
import json
import threading
from typing import Any

import numpy as np

_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# Deepest JSON schema taken (objects and arrays nested): real schemas are a few tens deep; a deeper
# one would overflow Python's recursion (json.dumps, the grammar compiler) instead of failing alone.
MAX_SCHEMA_DEPTH = 128
# Largest constraint compiled: a grammar's size sets its compile time (100,000 choices took the
# library 7-8 s, then failed with a Rust panic), so bigger ones are refused before compiling.
MAX_CHOICES = 4096
MAX_CONSTRAINT_CHARS = 1 << 20


def _depth_exceeds(value: Any, limit: int) -> bool:
    """Whether dicts and lists nest deeper than `limit` in `value` (iterative: no recursion)."""
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict | list | tuple):
            if d > limit:
                return True
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return False


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output (vLLM's `StructuredOutputsParams` names).

    json: a JSON schema (a dict or its JSON text); regex: the whole output matches it; choice:
    the output is one of these strings; grammar: a Lark (or GBNF) grammar; json_object: True for
    any JSON object. Exactly one of them must be set; ValueError otherwise.
    """

    json: str | dict | None = dataclasses.field(default=None, hash=False)
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)
        given = [k for k in _KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            what = "none are" if not given else f"{len(given)} are ({', '.join(given)})"
            raise ValueError(
                "structured_outputs: exactly one of json, regex, choice, grammar, json_object "
                f"must be set; {what} specified"
            )
        if self.json is not None:
            if isinstance(self.json, str) and len(self.json) > MAX_CONSTRAINT_CHARS:
                raise ValueError(
                    f"structured_outputs.json has {len(self.json)} characters, more than "
                    f"{MAX_CONSTRAINT_CHARS}"
                )
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except RecursionError:
                    raise ValueError(
                        f"structured_outputs.json is nested deeper than {MAX_SCHEMA_DEPTH} levels"
                    ) from None
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            else:
                schema = self.json
            if _depth_exceeds(schema, MAX_SCHEMA_DEPTH):
                raise ValueError(
                    f"structured_outputs.json is nested deeper than {MAX_SCHEMA_DEPTH} levels"
                )
            if not isinstance(schema, dict | bool):
                raise ValueError(
                    "structured_outputs.json must be a JSON schema (an object), got "
                    f"{type(schema).__name__}"
                )
        for name in ("regex", "grammar", "whitespace_pattern", "structural_tag"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(
                    f"structured_outputs.{name} must be a string, got {type(value).__name__}"
                )
            if value is not None and len(value) > MAX_CONSTRAINT_CHARS:
                raise ValueError(
                    f"structured_outputs.{name} has {len(value)} characters, more than "
                    f"{MAX_CONSTRAINT_CHARS}"
                )
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, list | tuple):
                raise ValueError("structured_outputs.choice must be a list of strings")
            if not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            if len(self.choice) > MAX_CHOICES:
                raise ValueError(
                    f"structured_outputs.choice has {len(self.choice)} alternatives, more than "
                    f"{MAX_CHOICES}"
                )
            set_("choice", tuple(self.choice))
        if self.json_object is not None and self.json_object is not True:
            raise ValueError("structured_outputs.json_object must be true when given")
        for name in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name} must be a bool")
        if self.structural_tag is not None:
            raise ValueError("structured_outputs.structural_tag is not supported by jaxserve")
        if self.whitespace_pattern is not None:
            raise ValueError(
                "structured_outputs.whitespace_pattern is not supported by the llguidance "
                "backend (use disable_any_whitespace)"
            )

    @classmethod
    def from_dict(cls, d: Any) -> StructuredOutputsParams:
        """From a JSON-like dict (a batch row, a request body); ValueError on an unknown key."""
        if isinstance(d, cls):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"structured_outputs must be an object, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        for key in d:
            if key not in names:
                raise ValueError(f"unknown structured_outputs field {key!r}")
        return cls(**d)

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) is not None)


def _no_additional_properties(schema):
    """vLLM's `disable_additional_properties`: every object schema without its own
    additionalProperties gets false."""
    if isinstance(schema, dict):
        out = {k: _no_additional_properties(v) for k, v in schema.items()}
        if out.get("type") == "object" and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_no_additional_properties(v) for v in schema]
    return schema


def grammar_spec(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON text) of a constraint; ValueError on bad input."""
    import llguidance

    options = {"whitespace_flexible": not params.disable_any_whitespace}
    try:
        if params.json is not None or params.json_object:
            schema = params.json if params.json is not None else {"type": "object"}
            if isinstance(schema, str):
                schema = json.loads(schema)
            if params.disable_additional_properties:
                schema = _no_additional_properties(schema)
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        if params.regex is not None:
            return llguidance.grammar_from("regex", params.regex)
        if params.choice is not None:
            return llguidance.grammar_from("choice", list(params.choice))
        return llguidance.grammar_from("grammar", params.grammar)
    except (ValueError, TypeError) as e:
        raise ValueError(f"structured_outputs.{params.kind}: {e}") from None


@dataclasses.dataclass(frozen=True)
class GrammarMasks:
    """One step's masks, what the engine hands the runner with the step's plan: the packed allowed
    tokens of each slot that samples under a grammar, and those slots."""

    bitmask: np.ndarray  # i32[num_slots, ceil(V / 32)]: bit t of word t // 32 allows token t
    rows: np.ndarray  # bool[num_slots]: the slot samples under its grammar's mask


class Grammar:
    """One request's matcher: which tokens may come next, advanced by each sampled token."""

    def __init__(self, matcher):
        self.matcher = matcher

    def accept(self, token: int) -> bool:
        """Advances by `token`; False when the grammar does not allow it (the matcher is then in
        its error state)."""
        return bool(self.matcher.consume_token(int(token)))

    def copy(self) -> Grammar:
        return Grammar(self.matcher.deep_copy())

    @property
    def is_terminated(self) -> bool:
        return bool(self.matcher.is_stopped())

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None


class StructuredOutputManager:
    """Compiles grammars for one engine's tokenizer and fills the step's bitmask (host only).

    The llguidance tokenizer (about a second to build) and the thread pool are made on the first
    constrained request, so engines that never see one pay nothing. Compiled grammar texts are
    cached by constraint, so n samples or repeated schemas compile once.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids=()):
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.words = (self.vocab_size + 31) // 32
        self.eos_token_ids = list(eos_token_ids)
        self._ll_tokenizer = None
        self._executor = None
        self._lock = threading.Lock()
        self._specs: dict[str, str] = {}

    def _setup(self):
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance
                import llguidance.hf

                eos = self.eos_token_ids or None
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self.tokenizer, n_vocab=self.vocab_size, eos_token=eos
                )
                self._executor = llguidance.LLExecutor()
        return self._ll_tokenizer

    def check(self, params: StructuredOutputsParams) -> str:
        """The grammar text of `params`, validated (and cached by constraint); ValueError naming
        the field when it does not compile. Safe from any thread: a server checks a request with
        it before the engine thread compiles the same constraint."""
        import llguidance

        if self.tokenizer is None:
            raise ValueError("structured_outputs need a tokenizer; this model has none")
        tok = self._setup()
        key = json.dumps(dataclasses.asdict(params), sort_keys=True, default=str)
        spec = self._specs.get(key)
        if spec is None:
            spec = grammar_spec(params)
            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(spec, tok)
            if is_error:
                raise ValueError(f"structured_outputs.{params.kind}: {messages[0].strip()}")
            if len(self._specs) > 1024:
                self._specs.clear()
            self._specs[key] = spec
        return spec

    def compile(self, params: StructuredOutputsParams) -> Grammar:
        """A fresh matcher for `params`; ValueError naming the field when it does not compile."""
        import llguidance

        spec = self.check(params)
        matcher = llguidance.LLMatcher(self._setup(), spec, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{params.kind}: {matcher.get_error()}")
        return Grammar(matcher)

    @staticmethod
    def sampling_rows(plan) -> dict[int, Grammar]:
        """slot -> Grammar of a plan's (`SchedulerOutput`) constrained rows that sample: decode
        rows and prompt-completing chunks (not those installing a token after a preemption)."""
        rows = {}
        for req, slot in zip(plan.decode, plan.decode_slots):
            if req.grammar is not None:
                rows[slot] = req.grammar
        for chunk, forced in zip(plan.prefill, plan.forced):
            if chunk.is_last and not forced and chunk.request.grammar is not None:
                rows[chunk.request.slot] = chunk.request.grammar
        return rows

    def masks(self, rows: dict[int, Grammar], num_slots: int) -> GrammarMasks:
        """The step's masks of `rows` (`sampling_rows`), over every slot."""
        flags = np.zeros((num_slots,), bool)
        flags[list(rows)] = True
        return GrammarMasks(self.fill_bitmask(rows, num_slots), flags)

    def fill_bitmask(self, rows: dict[int, Grammar], num_rows: int) -> np.ndarray:
        """i32[num_rows, ceil(V / 32)]: row r holds the allowed next tokens of rows[r]; the rows
        not in `rows` are all ones (every token allowed; the device ignores them anyway)."""
        from llguidance.numpy import fill_next_token_bitmask_par

        mask = np.full((num_rows, self.words), -1, np.int32)
        if rows:
            fill_next_token_bitmask_par(
                self._executor, [(g.matcher, r) for r, g in rows.items()], mask
            )
        return mask
