"""The tool-call parsers of tool_choice="auto" (the server's --tool_call_parser): each reads a
finished reply's text into (content, tool calls) by the rules of vLLM's parser of that name
(host only).

    content, calls = PARSERS[name].parse(text)    each call OpenAI's {"id", "type", "function"}

`PARSERS[name].markers` say where a call can begin and `closer` what ends one while the output
goes on (for `tool_calls.ToolCallStream`).
- `hermes` (Hermes, Qwen2.5, Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks; the content is the text before the first block.
- `llama3_json` (Llama 3.1-3.3): JSON objects {"name", "parameters"}, after an optional
  <|python_tag|>; with calls there is no content.
- `pythonic` (Llama 3.2 and 4): a reply that is a Python list of calls with keyword arguments,
  `[get_weather(city="Rome"), get_time()]`, read with `ast`, never evaluated; argument values
  are literals, JSON's null/true/false included.
- `mistral`: the `[TOOL_CALLS]` marker, then a JSON array of {"name", "arguments"} (tokenizers
  before v11, e.g. Mistral-7B-Instruct-v0.3) or `name[ARGS]{...}` / `name{...}` per marker (v11
  on); the content is the text before the first marker; the call ids are 9 letters and digits,
  which Mistral's chat templates require when the calls come back in the next request.
Text that does not parse as calls stays content, with no calls (vLLM's mistral parser returns
only the text after the marker then).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import random
import re
import string
from typing import Any

from jaxserve.entrypoints.openai.protocol.common import random_id

_START, _END = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)


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
