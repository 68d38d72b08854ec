"""Reads a batch job's input file into rows, validating each row on its own.

Dataflow:

    input file (bytes) -> a leading UTF-8 BOM dropped -> split on \\n, \\r\\n or \\r
      -> (line number, raw bytes) -> decode UTF-8 -> JSON object (JSONL) or the line (plain text)
      -> InputRow(line, key, id, prompt | messages | prompt_token_ids, sampling, fingerprint)
         or, when the row cannot run, InputRow(..., error="line N: <problem>")

A bad row never stops the job: it becomes an output row carrying its error, and every other row
runs. Every failure of one row (bad UTF-8, malformed or too deeply nested JSON, a number too large
for its field, a lone UTF-16 surrogate, an invalid sampling parameter) is caught here, for that row.
Blank lines are skipped (they are not rows). A JSONL row is an object with `id` (a string of at
most MAX_ID_CHARS characters, or an integer in [-2**63, 2**63)), exactly one of `prompt` (str),
`messages` (chat list; each content a string or OpenAI's content parts, see inputs/chat.py) or
`prompt_token_ids` (list of int), optional per-row `SamplingParams` fields overriding the
job's defaults, and an optional `lora` (the name of a LoRA adapter the job was given with
--lora_modules); any other field is an error.

A row's `key` names it for resume, sharding and merge, and never depends on its line number, so
inserting or deleting lines moves no answer to another row:
  - a JSONL row with a usable id: the JSON encoding of the id (`"q1"`, `7`);
  - a plain-text line: its id is `<first 16 hex digits of sha256(line bytes)>`, plus `#k` for the
    k-th (k > 1) occurrence of the same line, and its key is that id's JSON encoding;
  - a JSONL row whose id cannot be used (unreadable, missing, invalid, or a repeat of an earlier
    row's id): `raw:<16 hex digits of sha256(line bytes)>` (plus `#k` likewise); such rows are
    always errors, and error rows are retried on every run.

A runnable row's `fingerprint` is the SHA-256 of the canonical JSON of everything that decides its
answer (the prompt, the final sampling parameters including the derived seed, and whether the chat
template wraps plain prompts). Output rows record it, so resume redoes a row whose request changed.
A row that cannot run gets `error:<sha256 of its bytes and its error, which names its line>`:
the same bytes on the same line fail the same way, so resume does not rewrite that row; a fixed
row has new bytes and runs, a moved one gets its error row rewritten (no model needed).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any

from jaxserve.batch.sharding import derived_seed
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.inputs.chat import message_text

PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")
INPUT_FORMATS = ("auto", "jsonl", "text")
BOM = b"\xef\xbb\xbf"
MAX_ID_CHARS = 1024
_I32 = 2**31
_I64 = 2**63


@dataclasses.dataclass(frozen=True)
class InputRow:
    """One input row. Exactly one of prompt / messages / prompt_token_ids is set unless `error` is."""

    line: int  # 1-based line number in the input file
    key: str  # identity for resume / shards / merge (see the module docstring)
    id: str | int | None  # the row's id as written (text: the content hash); None: unusable
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt_token_ids: list[int] | None = None
    sampling: SamplingParams | None = None
    error: str | None = None  # "line N: <problem>" when the row cannot run
    fingerprint: str | None = None  # sha256 of the canonical request; "error:..." for a bad row
    lora: str | None = None  # the LoRA adapter's name (the job's --lora_modules), None: none


def row_key(row_id: str | int | None, line: int) -> str:
    """The key of a row with this id; `line:N` for an output row of an older jaxserve whose id
    was unusable (new output rows carry their `key`)."""
    return json.dumps(row_id) if row_id is not None else f"line:{line}"


def content_hash(raw: bytes) -> str:
    """16 hex digits of the SHA-256 of one input line's bytes."""
    return hashlib.sha256(raw).hexdigest()[:16]


def canonical_json(obj: Any) -> str:
    """One spelling per value: sorted keys, no spaces, ASCII only."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def request_fingerprint(
    field: str, value: Any, sampling: SamplingParams, use_chat_template: bool, lora=None
) -> str:
    """SHA-256 (hex) of everything that decides a row's answer (the adapter's name only when
    the row names one, so rows without one keep the fingerprints of older jaxserves)."""
    request = {
        field: value,
        "sampling": dataclasses.asdict(sampling),
        "use_chat_template": bool(use_chat_template),
    }
    if lora is not None:
        request["lora"] = lora
    return hashlib.sha256(canonical_json(request).encode("ascii")).hexdigest()


def check_input_path(path: str) -> None:
    """Raises ValueError unless `path` is a readable regular file (checked before the model loads)."""
    if not os.path.exists(path):
        raise ValueError(f"input file {path!r} does not exist")
    if not os.path.isfile(path):
        raise ValueError(f"input {path!r} is not a regular file")
    if not os.access(path, os.R_OK):
        raise ValueError(f"input file {path!r} is not readable")


def split_lines(data: bytes) -> list[bytes]:
    """The file's lines without their endings: a leading BOM dropped; \\n, \\r\\n and \\r end one."""
    if data.startswith(BOM):
        data = data[len(BOM) :]
    return data.splitlines()  # bytes.splitlines splits on exactly \n, \r\n and \r


def detect_format(path: str) -> str:
    """'jsonl' or 'text': by extension, else JSONL when the first non-blank line starts with '{'."""
    ext = os.path.splitext(path)[1].lower()
    if ext in (".jsonl", ".ndjson", ".json"):
        return "jsonl"
    if ext == ".txt":
        return "text"
    with open(path, "rb") as f:
        for raw in split_lines(f.read(1 << 20)):
            if raw.strip():
                return "jsonl" if raw.lstrip().startswith(b"{") else "text"
    return "text"


def read_input(
    path: str,
    *,
    input_format: str = "auto",
    sampling_defaults: dict[str, Any] | None = None,
    base_seed: int | None = None,
    use_chat_template: bool = False,
) -> list[InputRow]:
    """Parses and validates every row of `path`.

    sampling_defaults: SamplingParams fields applied to every row unless the row sets them.
    base_seed: when not None, a row without its own `seed` gets `derived_seed(base_seed, key)`.
    use_chat_template: whether the job wraps plain prompts in the chat template (a part of each
    row's fingerprint).
    """
    if input_format not in INPUT_FORMATS:
        raise ValueError(f"input_format must be one of {INPUT_FORMATS}, got {input_format!r}")
    check_input_path(path)
    fmt = detect_format(path) if input_format == "auto" else input_format
    with open(path, "rb") as f:
        data = f.read()
    parser = _Parser(dict(sampling_defaults or {}), base_seed, use_chat_template)
    parse = parser.text_line if fmt == "text" else parser.jsonl_line
    rows = []
    for line, raw in enumerate(split_lines(data), start=1):
        if not raw.strip():
            continue
        try:
            row = parse(line, raw)
        except Exception as e:  # last line of defence: a check above missed a case
            key = parser.content_key("raw:", raw)
            error = f"line {line}: unreadable row ({type(e).__name__}: {_short(e)})"
            row = InputRow(line, key, None, error=error)
        if row.error is not None:  # the same line fails the same way: resume need not redo it
            fp = hashlib.sha256(raw + b"\0" + row.error.encode("utf-8"))  # holds "line N"
            row = dataclasses.replace(row, fingerprint="error:" + fp.hexdigest())
        rows.append(row)
    return rows


class _Parser:
    """Parses lines one at a time; remembers the keys seen so far (duplicates, occurrences)."""

    def __init__(self, defaults: dict[str, Any], base_seed: int | None, use_chat_template: bool):
        self.defaults = defaults
        self.base_seed = base_seed
        self.use_chat_template = use_chat_template
        self.seen: dict[str, int] = {}  # key -> line of its first occurrence
        self.occurrences: dict[str, int] = {}  # content hash -> times seen

    def content_key(self, prefix: str, raw: bytes) -> str:
        h = prefix + content_hash(raw.strip())
        k = self.occurrences[h] = self.occurrences.get(h, 0) + 1
        return h if k == 1 else f"{h}#{k}"

    def text_line(self, line: int, raw: bytes) -> InputRow:
        row_id = self.content_key("", raw)
        key = row_key(row_id, line)
        text, err = _decode(line, raw)
        if err:
            return InputRow(line, key, row_id, error=err)
        sampling, err = self.sampling(line, key, {})
        if err:
            return InputRow(line, key, row_id, error=err)
        fp = request_fingerprint("prompt", text, sampling, self.use_chat_template)
        return InputRow(line, key, row_id, prompt=text, sampling=sampling, fingerprint=fp)

    def jsonl_line(self, line: int, raw: bytes) -> InputRow:
        def bad(problem: str, row_id: Any = None) -> InputRow:
            key = self.content_key("raw:", raw)
            return InputRow(line, key, row_id, error=f"line {line}: {problem}")

        text, err = _decode(line, raw)
        if err:
            return bad(err.split(": ", 1)[1])
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            return bad(f"malformed JSON ({e.msg} at column {e.colno})")
        except RecursionError:
            return bad("malformed JSON (nested too deeply)")
        except ValueError as e:  # e.g. an integer of more than sys.get_int_max_str_digits()
            return bad(f"malformed JSON ({_short(e)})")
        if not isinstance(obj, dict):
            return bad(f"expected a JSON object, got {type(obj).__name__}")
        problem = _surrogates(obj)
        if problem:
            return bad(problem)

        row_id = obj.get("id")
        if row_id is None:
            return bad("missing 'id'")
        if isinstance(row_id, bool) or not isinstance(row_id, str | int):
            return bad(f"'id' must be a string or an integer, got {type(row_id).__name__}")
        if isinstance(row_id, int) and not -_I64 <= row_id < _I64:
            return bad("'id' must be an integer in [-2**63, 2**63) or a string")
        if row_id == "":
            return bad("'id' is an empty string")
        if isinstance(row_id, str) and len(row_id) > MAX_ID_CHARS:
            return bad(f"'id' is longer than {MAX_ID_CHARS} characters")
        key = row_key(row_id, line)
        if key in self.seen:
            return bad(f"duplicate id {row_id!r} (first on line {self.seen[key]})")
        self.seen[key] = line

        def fail(problem: str) -> InputRow:
            return InputRow(line, key, row_id, error=f"line {line}: {problem}")

        given = [name for name in PROMPT_FIELDS if name in obj]
        if not given:
            return fail("missing 'prompt' (or 'messages' / 'prompt_token_ids')")
        if len(given) > 1:
            return fail(f"give only one of {given}")
        field = given[0]
        value = obj[field]
        problem = _PROMPT_CHECKS[field](value)
        if problem:
            return fail(problem)

        lora = obj.get("lora")
        if lora is not None and (not isinstance(lora, str) or not lora or len(lora) > MAX_ID_CHARS):
            return fail(f"'lora' must be an adapter's name (a non-empty string), got {lora!r:.80}")
        skip = {"id", "lora", *PROMPT_FIELDS}
        overrides = {k: v for k, v in obj.items() if k not in skip}
        sampling, err = self.sampling(line, key, overrides)
        if err:
            return InputRow(line, key, row_id, error=err)
        fp = request_fingerprint(field, value, sampling, self.use_chat_template, lora)
        return InputRow(
            line, key, row_id, sampling=sampling, fingerprint=fp, lora=lora, **{field: value}
        )

    def sampling(
        self, line: int, key: str, overrides: dict[str, Any]
    ) -> tuple[SamplingParams | None, str | None]:
        fields = {**self.defaults, **overrides}
        if fields.get("seed") is None and self.base_seed is not None:
            fields["seed"] = derived_seed(self.base_seed, key)
        try:
            return SamplingParams.from_dict(fields), None
        # SamplingParams raises ValueError naming the field, also for a value too large for the
        # engine's int32 / float arrays; TypeError / OverflowError would be a check it missed.
        except (ValueError, TypeError, OverflowError) as e:
            return None, f"line {line}: {_short(e)}"


def _short(e: BaseException) -> str:
    s = str(e)
    return s if len(s) <= 300 else s[:297] + "..."


def _decode(line: int, raw: bytes) -> tuple[str | None, str | None]:
    try:
        return raw.decode("utf-8"), None
    except UnicodeDecodeError as e:
        return None, f"line {line}: not valid UTF-8 ({e.reason} at byte {e.start})"


def _surrogates(obj: Any, path: str = "") -> str | None:
    """Names the first string holding a lone UTF-16 surrogate (a JSON "\\ud800" escape), which no
    tokenizer or UTF-8 writer accepts, or None. Iterative: the JSON parser already bounds depth."""
    stack = [(path, obj)]
    while stack:
        where, x = stack.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                return f"{where.lstrip('.') or 'a string'} holds a lone UTF-16 surrogate"
        elif isinstance(x, dict):
            for k, v in x.items():
                stack.append((f"{where} key", k))
                stack.append((f"{where}.{k}" if _printable(k) else f"{where}.?", v))
        elif isinstance(x, list):
            stack.extend((f"{where}[{i}]", v) for i, v in enumerate(x))
    return None


def _printable(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return len(s) < 64


def _check_prompt(value: Any) -> str | None:
    if not isinstance(value, str):
        return f"'prompt' must be a string, got {type(value).__name__}"
    if value == "":
        return "empty prompt"
    return None


def _check_messages(value: Any) -> str | None:
    if not isinstance(value, list) or not value:
        return "'messages' must be a non-empty list of {role, content} objects"
    texts = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            return f"messages[{i}] must be an object, got {type(m).__name__}"
        if not isinstance(m.get("role"), str):
            return f"messages[{i}].role must be a string"
        if m.get("content") is None:  # message_text checks any other value
            return f"messages[{i}].content must be a string or a list of content parts"
        try:
            texts.append(message_text(m["content"], f"messages[{i}].content"))
        except ValueError as e:
            return str(e)
    if all(t == "" for t in texts):
        return "empty prompt (every message's content is empty)"
    return None


def _check_token_ids(value: Any) -> str | None:
    ok = isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < _I32 for t in value
    )
    if not ok:
        return "'prompt_token_ids' must be a list of token ids in [0, 2**31)"
    if not value:
        return "empty prompt ('prompt_token_ids' is empty)"
    return None


_PROMPT_CHECKS = {
    "prompt": _check_prompt,
    "messages": _check_messages,
    "prompt_token_ids": _check_token_ids,
}
