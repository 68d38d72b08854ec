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
  the text by the server's --tool_call_parser (`tool_parsers.py`: hermes, llama3_json, pythonic,
  mistral). Without --enable_auto_tool_choice that is a 400, as in vLLM. Streamed, the text before
  the first call marker is sent as content as it comes, so with llama3_json a reply that begins
  with words and then calls keeps those words (vLLM's non-streamed parse drops them; its stream
  keeps the whole reply as content).
Named functions and "required" need no parser here (the grammar fixes the format); vLLM 0.32 asks
for one. A structured output (`response_format` / `structured_outputs`) cannot be combined with a
named function or "required": each is a grammar on the same output.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from jaxserve.entrypoints.openai.protocol.common import random_id
from jaxserve.entrypoints.openai.tool_parsers import _DECODER, PARSERS, _call, _named_call


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
