"""Tool calls in chat completions, as vLLM's server makes them (host only, no engine):

    use = ToolUse.of(tools, tool_choice, parallel_tool_calls, parser, auto)   # or ToolError
    use.schema                     the JSON schema the output must follow, or None
    content, calls = use.parse(text)            the message's content and its tool_calls
    use.finish_reason(c.finish_reason, bool(calls))   "tool_calls" where OpenAI's says so
    stream = ToolCallStream(use); stream.update(text, finished) -> (content delta, tool_call deltas)

`tool_choice`:
- "none" (the default without tools): the template sees the tools; the output is plain text.
- a named function, {"type": "function", "function": {"name": ...}}: the output is a structured
  output, a JSON object following that function's `parameters` schema: the message holds one tool
  call with those arguments and content ""; finish_reason stays the output's own ("stop"), as
  OpenAI's API and vLLM's give for a named function.
- "required": the output follows vLLM's schema, a JSON array of at least one {"name",
  "parameters"} (at most one with parallel_tool_calls=false), each following its tool's schema;
  each becomes a tool call; finish_reason "tool_calls".
- "auto" (the default when tools are given): the model chooses, and its calls are parsed out of
  the text by the server's --tool_call_parser. Without --enable_auto_tool_choice that is a 400, as
  in vLLM. Parsers (vLLM's names and rules): `hermes` (Hermes, Qwen2.5, Qwen3: `<tool_call>{"name":
  ..., "arguments": {...}}</tool_call>` blocks; the content is the text before the first block)
  and `llama3_json` (Llama 3.1-3.3: JSON objects {"name", "parameters"}, after an optional
  <|python_tag|>; with calls there is no content), `pythonic` (Llama 3.2 and 4: a reply that is a
  Python list of calls with keyword arguments, `[get_weather(city="Rome"), get_time()]`, read
  with `ast`, never evaluated; argument values are literals, JSON's null/true/false included)
  and `mistral` (Mistral's `[TOOL_CALLS]` marker, then a JSON array of {"name", "arguments"}
  (tokenizers before v11, e.g. Mistral-7B-Instruct-v0.3) or `name[ARGS]{...}` / `name{...}`
  per marker (v11 on); the content is the text before the first marker; the call ids are 9
  letters and digits, which Mistral's chat templates require when the calls come back in the
  next request). Text that does not parse as calls stays content, with no calls (vLLM's mistral
  parser returns only the text after the marker then). Streamed, the text before the first call
  marker is sent as content as it comes, so with llama3_json a reply that begins with words and
  then calls keeps those words (vLLM's non-streamed parse drops them; its stream keeps the whole
  reply as content).
Named functions and "required" need no parser here (the grammar fixes the format); vLLM 0.32 asks
for one. A structured output (`response_format` / `structured_outputs`) cannot be combined with a
named function or "required": each is a grammar on the same output.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import random
import re
import string
from typing import Any

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from jaxserve.entrypoints.openai.protocol import random_id

_START, _END = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)


class ToolError(ValueError):
    """A bad `tools` / `tool_choice`: the message, and the field it names."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class _Function(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class _Tool(_Strict):
    type: str = "function"
    function: _Function


_TOOLS = TypeAdapter(list[_Tool])
_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


@dataclasses.dataclass(frozen=True)
class ToolUse:
    mode: str  # "none" | "named" | "required" | "auto"
    name: str | None = None  # the named function
    schema: dict[str, Any] | None = None  # what the output must follow
    parser: str | None = None  # for "auto"
    single: bool = False  # parallel_tool_calls=false: the first call only

    @classmethod
    def of(cls, tools, tool_choice, parallel_tool_calls=None, parser=None, auto=False):
        """The request's tool use; ToolError (a 400) naming the field, as vLLM's checks."""
        if tools is not None and len(tools) == 0:
            raise ToolError(
                "`tools` must not be an empty array. Either provide at least one tool or "
                "omit the field entirely.",
                "tools",
            )
        parsed = []
        if tools is not None:
            try:
                parsed = _TOOLS.validate_python(tools)
            except ValidationError as e:
                err = e.errors()[0]
                where = ".".join(str(p) for p in err["loc"])
                raise ToolError(f"tools[{where}]: {err['msg']}", "tools") from None
        if tool_choice is None:
            tool_choice = "auto" if tools else "none"
        if tool_choice == "none":
            return cls("none")
        if tools is None:
            raise ToolError("When using `tool_choice`, `tools` must be set.", "tool_choice")
        functions = {t.function.name: t.function for t in parsed if t.type == "function"}
        single = parallel_tool_calls is False
        if isinstance(tool_choice, dict):
            function = tool_choice.get("function")
            if not isinstance(function, dict):
                raise ToolError(
                    f"Invalid value for `function`: `{function}` in `tool_choice`! {_USAGE}",
                    "tool_choice.function",
                )
            name = function.get("name")
            if not isinstance(name, str) or not name:
                raise ToolError(
                    f"Invalid `name` in `function`: `{name}` in `tool_choice`! {_USAGE}",
                    "tool_choice.function.name",
                )
            if name not in functions:
                raise ToolError(
                    "The tool specified in `tool_choice` does not match any of the specified "
                    "`tools`",
                    "tool_choice",
                )
            return cls("named", name, _params(functions[name].parameters), single=single)
        if tool_choice == "required":
            if not functions:
                raise ToolError(
                    "tool_choice requires a function call, but tools contains no function "
                    "tool the model can call.",
                    "tools",
                )
            return cls("required", schema=_required_schema(functions, single), single=single)
        if tool_choice == "auto":
            if not auto or parser is None:
                raise ToolError(
                    '"auto" tool choice requires --enable_auto_tool_choice and '
                    "--tool_call_parser to be set",
                    "tool_choice",
                )
            return cls("auto", parser=parser, single=single)
        raise ToolError(
            f'Invalid value for `tool_choice`: {tool_choice}! Only named tools, "none", '
            '"auto" or "required" are supported.',
            "tool_choice",
        )

    @property
    def constrains(self) -> bool:
        return self.schema is not None

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool calls) of a finished output; each call is OpenAI's
        {"id", "type": "function", "function": {"name", "arguments"}} (arguments a JSON string)."""
        if self.mode == "named":
            calls = [_call(self.name, text)] if text.strip() else []
            return "", calls
        if self.mode == "required":
            try:
                calls = [_named_call(it, "parameters") for it in json.loads(text)]
            except (ValueError, TypeError, KeyError):  # cut short by max_tokens or a stop
                calls = []
            return "", calls[:1] if self.single else calls
        if self.mode == "auto":
            content, calls = PARSERS[self.parser].parse(text)
            return content, calls[:1] if self.single else calls
        return text, []

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        if self.mode == "auto" and called:
            return "tool_calls"
        if self.mode == "required" and reason == "stop":
            return "tool_calls"
        return reason


def _params(params: dict[str, Any] | None) -> dict[str, Any]:
    return params if params else {"type": "object", "properties": {}}


def _required_schema(functions: dict[str, _Function], single: bool) -> dict[str, Any]:
    """vLLM's schema for tool_choice="required" (`$defs` of every tool hoisted to the top)."""
    defs: dict[str, Any] = {}
    variants = []
    for name, fn in functions.items():
        params = dict(_params(fn.parameters))
        tool_defs = params.pop("$defs", {})
        if not isinstance(tool_defs, dict):
            raise ToolError(
                f"`$defs` in the parameters of tool '{name}' must be an object, got "
                f"{type(tool_defs).__name__}.",
                "tools",
            )
        for key, value in tool_defs.items():
            if key in defs and defs[key] != value:
                raise ToolError(
                    f"Tool definition '{key}' has multiple schemas, which is not supported.",
                    "tools",
                )
            defs[key] = value
        variants.append(
            {
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": variants}}  # fmt: skip
    if single:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _call(name: str, arguments: str, call_id: str | None = None) -> dict:
    return {
        "id": call_id or random_id("chatcmpl-tool"),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _named_call(obj: Any, *keys: str) -> dict:
    """A call from a parsed {"name", <arguments key>} object; ValueError if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("not a tool call")
    key = next((k for k in keys if k in obj), None)
    if key is None:
        raise ValueError("a tool call without arguments")
    return _call(obj["name"], json.dumps(obj[key], ensure_ascii=False))


def _parse_hermes(text: str) -> tuple[str | None, list[dict]]:
    """vLLM's hermes parser: every <tool_call> block (the last may be unterminated); the content
    is the text before the first block. Text that does not parse stays content, with no calls."""
    if _START not in text:
        return text, []
    blocks = [a if a else b for a, b in _HERMES_BLOCK.findall(text)]
    try:
        calls = [_named_call(json.loads(b), "arguments") for b in blocks]
    except ValueError:
        return text, []
    content = text[: text.find(_START)]
    return (content if content else None), calls


_DECODER = json.JSONDecoder()


def _parse_llama3_json(text: str) -> tuple[str | None, list[dict]]:
    """vLLM's llama3_json parser (Llama 3.1-3.3's JSON tool calls, after an optional
    <|python_tag|>): every JSON object not inside an earlier one is a call {"name", "arguments"
    or "parameters"}; with calls there is no content. If any object is not a call, the whole
    text is content."""
    calls, end = [], -1
    for m in re.finditer(r"\{", text):
        if m.start() < end:
            continue
        try:
            obj, n = _DECODER.raw_decode(text, m.start())
            calls.append(_named_call(obj, "arguments", "parameters"))
        except ValueError:
            return text, []
        end = n
    return (None, calls) if calls else (text, [])


_PYTHONIC_START = re.compile(r"\[[A-Za-z_][\w.]*\(")  # "[name(" opens a pythonic reply
_JSON_NAMES = {"null": None, "true": True, "false": False}


def _parse_pythonic(text: str) -> tuple[str | None, list[dict]]:
    """vLLM's pythonic parser (Llama 3.2 and 4): a reply that begins `[name(` and is a Python list
    of calls, `[f(a=1, b="x"), g()]`, becomes those calls and no content; anything else, or
    any argument that is not a literal, leaves the whole text as content."""
    if not _PYTHONIC_START.match(text):
        return text, []
    try:
        body = ast.parse(text).body
        listed = body[0].value if body and isinstance(body[0], ast.Expr) else None
        if not isinstance(listed, ast.List) or not listed.elts:
            return text, []
        calls = [_pythonic_call(c) for c in listed.elts]
    except (SyntaxError, ValueError, RecursionError):
        return text, []
    return None, calls


def _pythonic_call(node: ast.expr) -> dict:
    if not isinstance(node, ast.Call) or node.args:
        raise ValueError("not a call with keyword arguments")
    parts, func = [], node.func
    while isinstance(func, ast.Attribute):  # a dotted name: tools.search(...)
        parts.append(func.attr)
        func = func.value
    if not isinstance(func, ast.Name):
        raise ValueError("not a named function")
    name = ".".join([func.id, *reversed(parts)])
    if any(k.arg is None for k in node.keywords):  # **kwargs
        raise ValueError("unpacked arguments")
    args = {k.arg: _literal(k.value) for k in node.keywords}
    return _call(name, json.dumps(args, ensure_ascii=False))


def _literal(node: ast.expr) -> Any:
    """A JSON value from a Python literal (a tuple or set becomes a list, null/true/false their
    JSON values); ValueError for anything else (a variable, a call, an f-string with fields)."""
    if isinstance(node, ast.Constant) and (
        node.value is None or isinstance(node.value, (str, int, float))
    ):
        return node.value
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) for k in node.keys):
        return {k.value: _literal(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return [_literal(v) for v in node.elts]
    if isinstance(node, ast.JoinedStr) and all(isinstance(p, ast.Constant) for p in node.values):
        return "".join(str(p.value) for p in node.values)
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    raise ValueError(f"not a literal: {ast.dump(node)[:80]}")


_MISTRAL_CALLS, _MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
_ALNUM = string.ascii_letters + string.digits


def _mistral_id() -> str:
    """Mistral's chat templates take back only tool-call ids of 9 letters and digits."""
    return "".join(random.choices(_ALNUM, k=9))


def _parse_mistral(text: str) -> tuple[str | None, list[dict]]:
    """Mistral's tool calls: the text before the first [TOOL_CALLS] is the content; after it a
    JSON array of {"name", "arguments"} (or one such object; tokenizers before v11), or, after
    each marker, `name[ARGS]{...}` or `name{...}` (v11 on; text after the arguments' JSON is
    dropped). Array entries that are not calls are skipped (as vLLM); if no call is left, or a
    v11 segment does not parse, the whole text is content."""
    if _MISTRAL_CALLS not in text:
        return text, []
    content, *segments = text.split(_MISTRAL_CALLS)
    segments = [seg.strip() for seg in segments if seg.strip()]
    calls = []
    try:
        if segments and segments[0][0] in "[{":  # before v11: one JSON value of calls
            parsed, _ = _DECODER.raw_decode(segments[0])
            for it in parsed if isinstance(parsed, list) else [parsed]:
                if not isinstance(it, dict) or not isinstance(it.get("name"), str):
                    continue
                args = it.get("arguments", {})
                args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
                calls.append(_call(it["name"], args, _mistral_id()))
        else:
            for seg in segments:
                cut = seg.find(_MISTRAL_ARGS)
                name, rest = (
                    (seg[:cut], seg[cut + len(_MISTRAL_ARGS) :])
                    if cut >= 0
                    else (seg[: seg.find("{")], seg[seg.find("{") :])
                )
                if "{" not in seg or not name.strip():
                    raise ValueError("no name{arguments}")
                rest = rest.strip()
                args, end = _DECODER.raw_decode(rest)
                if not isinstance(args, dict):
                    raise ValueError("arguments are not an object")
                calls.append(_call(name.strip(), rest[:end], _mistral_id()))
    except ValueError:
        return text, []
    if not calls:
        return text, []
    return (content if content.strip() else None), calls


@dataclasses.dataclass(frozen=True)
class _Parser:
    parse: Any  # text -> (content, calls)
    markers: tuple[str, ...]  # where tool-call text can begin
    closer: str | None  # what ends one call while the output goes on (None: only its end)
    at_start: bool = False  # a call can begin only at the text's start (pythonic)


PARSERS = {
    "hermes": _Parser(_parse_hermes, (_START,), _END),
    "llama3_json": _Parser(_parse_llama3_json, ("<|python_tag|>", "{"), None),
    "mistral": _Parser(_parse_mistral, (_MISTRAL_CALLS,), None),
    "pythonic": _Parser(_parse_pythonic, ("[",), None, at_start=True),
}
TOOL_CALL_PARSERS = tuple(PARSERS)


class ToolCallStream:
    """The tool-call view of a streamed choice: `update(text, finished)` with the output's text so
    far returns (content delta or None, tool-call deltas). A named function streams its arguments
    as they come (the first delta carries the call's id and name); "required" sends each call
    as its object in the array closes (so an output cut short by max_tokens keeps the calls
    already sent, where the whole reply's parse has none); "auto" streams the content before the parser's first
    call marker (holding back what may be the start of one), then each hermes call once its block
    closes, the other parsers' calls once the output is finished (a pythonic reply is content
    as it comes unless it begins with "[")."""

    def __init__(self, use: ToolUse):
        self.use = use
        self.sent = 0  # characters of text (content or arguments) sent
        self.calls = 0  # tool calls sent
        self.id = random_id("chatcmpl-tool") if use.mode == "named" else None

    def update(self, text: str, finished: bool) -> tuple[str | None, list[dict]]:
        mode = self.use.mode
        if mode == "none":
            delta, self.sent = text[self.sent :], len(text)
            return delta, []
        if mode == "named":
            delta, self.sent = text[self.sent :], len(text)
            if self.calls == 0:
                if not delta:
                    return None, []
                self.calls = 1
                fn = {"name": self.use.name, "arguments": delta}
                return None, [{"index": 0, "id": self.id, "type": "function", "function": fn}]
            return None, ([{"index": 0, "function": {"arguments": delta}}] if delta else [])
        if mode == "required":
            calls = self.use.parse(text)[1] if finished else _closed_items(text)
            return None, self._new_calls(calls[:1] if self.use.single else calls)
        parser = PARSERS[self.use.parser]  # "auto"
        start = _first(text, parser.markers, parser.at_start)
        if finished:
            content, calls = self.use.parse(text)
            upto = start if calls else len(text)
            delta = text[self.sent : upto] if upto > self.sent else None
            self.sent = max(self.sent, upto)
            return delta, self._new_calls(calls)
        upto = start if start >= 0 else _safe_end(text, parser.markers, parser.at_start)
        delta = text[self.sent : upto] if upto > self.sent else None
        self.sent = max(self.sent, upto)
        if start < 0 or parser.closer is None or parser.closer not in text:
            return delta, []
        closed = text.rfind(parser.closer) + len(parser.closer)
        if closed <= start:
            return delta, []
        calls = parser.parse(text[:closed])[1]
        return delta, self._new_calls(calls[:1] if self.use.single else calls)

    def _new_calls(self, calls: list[dict]) -> list[dict]:
        fresh = [{"index": self.calls + i, **c} for i, c in enumerate(calls[self.calls :])]
        self.calls = max(self.calls, len(calls))
        return fresh


def _closed_items(text: str) -> list[dict]:
    """The calls of "required"'s JSON array whose objects have closed so far (the grammar keeps
    the array well formed, so each object parses once its closing brace is out)."""
    calls, at = [], text.find("[") + 1
    while 0 < at < len(text):
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        try:
            obj, at = _DECODER.raw_decode(text, at)
            calls.append(_named_call(obj, "parameters"))
        except ValueError:  # not closed yet (or not a call: the finished parse decides)
            break
    return calls


def _first(text: str, markers: tuple[str, ...], at_start: bool = False) -> int:
    """Where the first marker begins (only at 0 when at_start), or -1."""
    if at_start:
        return 0 if any(text.startswith(m) for m in markers) else -1
    found = [i for i in (text.find(m) for m in markers) if i >= 0]
    return min(found) if found else -1


def _safe_end(text: str, markers: tuple[str, ...], at_start: bool = False) -> int:
    """Where the content that cannot be the start of a marker ends (holding back a suffix that
    may grow into one; with at_start, holding back an empty start only)."""
    if at_start:
        return len(text)
    longest = max(len(m) for m in markers)
    for k in range(min(longest - 1, len(text)), 0, -1):
        if any(m.startswith(text[-k:]) for m in markers):
            return len(text) - k
    return len(text)
