"""Reads a batch job's input file into rows, validating each row on its own.

Dataflow:

    input file (bytes) --split on b"\\n"--> (line number, raw bytes)
      -> decode UTF-8 -> JSON object (JSONL) or the line itself (plain text)
      -> InputRow(line, key, id, prompt | messages | prompt_token_ids, sampling: SamplingParams)
         or, when the row cannot run, InputRow(..., error="line N: <problem>")

A bad row never stops the job: it becomes an output row carrying its error, and every other row
runs. Blank lines are skipped (they are not rows). A JSONL row is an object with `id` (str or int),
exactly one of `prompt` (str), `messages` (chat list) or `prompt_token_ids` (list of int), and
optional per-row `SamplingParams` fields overriding the job's defaults; any other field is an error.
In a plain text file each line is one prompt and its id is its line number (1-based).

A row's `key` names it for resume, sharding and merge: the JSON encoding of its id, or `line:N` for a
row whose id cannot be used (unreadable, missing, or a repeat of an earlier row's id).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from jaxserve.batch.sharding import derived_seed
from jaxserve.core.sampling_params import SamplingParams

PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")
INPUT_FORMATS = ("auto", "jsonl", "text")


@dataclasses.dataclass(frozen=True)
class InputRow:
    """One input row. Exactly one of prompt / messages / prompt_token_ids is set unless `error` is."""

    line: int  # 1-based line number in the input file
    key: str  # identity for resume / shards / merge: json.dumps(id), or "line:N"
    id: str | int | None  # the row's id as written; None when it could not be used
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt_token_ids: list[int] | None = None
    sampling: SamplingParams | None = None
    error: str | None = None  # "line N: <problem>" when the row cannot run


def row_key(row_id: str | int | None, line: int) -> str:
    """The key of a row with this id (None: an unusable id) on this line."""
    return json.dumps(row_id) if row_id is not None else f"line:{line}"


def check_input_path(path: str) -> None:
    """Raises ValueError unless `path` is a readable regular file (checked before the model loads)."""
    if not os.path.exists(path):
        raise ValueError(f"input file {path!r} does not exist")
    if not os.path.isfile(path):
        raise ValueError(f"input {path!r} is not a regular file")
    if not os.access(path, os.R_OK):
        raise ValueError(f"input file {path!r} is not readable")


def detect_format(path: str) -> str:
    """'jsonl' or 'text': by extension, else JSONL when the first non-blank line starts with '{'."""
    ext = os.path.splitext(path)[1].lower()
    if ext in (".jsonl", ".ndjson", ".json"):
        return "jsonl"
    if ext == ".txt":
        return "text"
    with open(path, "rb") as f:
        for raw in f:
            if raw.strip():
                return "jsonl" if raw.lstrip().startswith(b"{") else "text"
    return "text"


def read_input(
    path: str,
    *,
    input_format: str = "auto",
    sampling_defaults: dict[str, Any] | None = None,
    base_seed: int | None = None,
) -> list[InputRow]:
    """Parses and validates every row of `path`.

    sampling_defaults: SamplingParams fields applied to every row unless the row sets them.
    base_seed: when not None, a row without its own `seed` gets `derived_seed(base_seed, key)`.
    """
    if input_format not in INPUT_FORMATS:
        raise ValueError(f"input_format must be one of {INPUT_FORMATS}, got {input_format!r}")
    check_input_path(path)
    fmt = detect_format(path) if input_format == "auto" else input_format
    defaults = dict(sampling_defaults or {})
    seen: dict[str, int] = {}  # key -> line of its first occurrence
    rows = []
    with open(path, "rb") as f:
        for line, raw in enumerate(f, start=1):
            raw = raw.rstrip(b"\r\n")
            if not raw.strip():
                continue
            parse = _parse_text_line if fmt == "text" else _parse_jsonl_line
            rows.append(parse(line, raw, seen, defaults, base_seed))
    return rows


def _decode(line: int, raw: bytes) -> tuple[str | None, str | None]:
    try:
        return raw.decode("utf-8"), None
    except UnicodeDecodeError as e:
        return None, f"line {line}: not valid UTF-8 ({e.reason} at byte {e.start})"


def _parse_text_line(line, raw, seen, defaults, base_seed) -> InputRow:
    key = row_key(line, line)
    seen[key] = line
    text, err = _decode(line, raw)
    if err:
        return InputRow(line, key, line, error=err)
    sampling, err = _sampling(line, key, {}, defaults, base_seed)
    return InputRow(line, key, line, prompt=text, sampling=sampling, error=err)


def _parse_jsonl_line(line, raw, seen, defaults, base_seed) -> InputRow:
    bad = lambda problem, row_id=None: InputRow(
        line, row_key(row_id, line), row_id, error=f"line {line}: {problem}"
    )
    text, err = _decode(line, raw)
    if err:
        return InputRow(line, row_key(None, line), None, error=err)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return bad(f"malformed JSON ({e.msg} at column {e.colno})")
    if not isinstance(obj, dict):
        return bad(f"expected a JSON object, got {type(obj).__name__}")

    row_id = obj.get("id")
    if row_id is None:
        return bad("missing 'id'")
    if isinstance(row_id, bool) or not isinstance(row_id, str | int):
        return bad(f"'id' must be a string or an integer, got {type(row_id).__name__}")
    if row_id == "":
        return bad("'id' is an empty string")
    key = row_key(row_id, line)
    if key in seen:
        return bad(f"duplicate id {row_id!r} (first on line {seen[key]})")
    seen[key] = line

    given = [name for name in PROMPT_FIELDS if name in obj]
    if not given:
        return bad("missing 'prompt' (or 'messages' / 'prompt_token_ids')", row_id)
    if len(given) > 1:
        return bad(f"give only one of {given}", row_id)
    field = given[0]
    value = obj[field]
    problem = _PROMPT_CHECKS[field](value)
    if problem:
        return bad(problem, row_id)

    overrides = {k: v for k, v in obj.items() if k != "id" and k not in PROMPT_FIELDS}
    sampling, err = _sampling(line, key, overrides, defaults, base_seed)
    return InputRow(line, key, row_id, sampling=sampling, error=err, **{field: value})


def _check_prompt(value: Any) -> str | None:
    if not isinstance(value, str):
        return f"'prompt' must be a string, got {type(value).__name__}"
    if value == "":
        return "empty prompt"
    return None


def _check_messages(value: Any) -> str | None:
    if not isinstance(value, list) or not value:
        return "'messages' must be a non-empty list of {role, content} objects"
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            return f"messages[{i}] must be an object, got {type(m).__name__}"
        for name in ("role", "content"):
            if not isinstance(m.get(name), str):
                return f"messages[{i}].{name} must be a string"
    if all(m["content"] == "" for m in value):
        return "empty prompt (every message's content is empty)"
    return None


def _check_token_ids(value: Any) -> str | None:
    ok = isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    )
    if not ok:
        return "'prompt_token_ids' must be a list of non-negative integers"
    if not value:
        return "empty prompt ('prompt_token_ids' is empty)"
    return None


_PROMPT_CHECKS = {
    "prompt": _check_prompt,
    "messages": _check_messages,
    "prompt_token_ids": _check_token_ids,
}


def _sampling(
    line, key, overrides, defaults, base_seed
) -> tuple[SamplingParams | None, str | None]:
    fields = {**defaults, **overrides}
    if fields.get("seed") is None and base_seed is not None:
        fields["seed"] = derived_seed(base_seed, key)
    try:
        return SamplingParams.from_dict(fields), None
    except (ValueError, TypeError) as e:  # TypeError: a value of a shape the dataclass rejects
        return None, f"line {line}: {e}"
