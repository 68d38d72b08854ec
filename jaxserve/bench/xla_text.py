"""Reading XLA's text: the optimized HLO module and the GPU thunk sequence, as XLA prints them.

    parse_module(hlo) -> ({computation: [Instruction]}, entry)   instructions in schedule order
    parse_instruction(line) -> Instruction | None                 one `%name = shape op(...), attrs`
    parse_thunks(text) -> [Thunk]                                 the thunk forest, by indentation
    array_shapes(shape) / shape_bytes(shape) / attr(attrs, key) / trip_count(while)

`gpu_report.py` builds its per-step counts on these. Plain text in, plain data out: no jax.
"""

from __future__ import annotations

import dataclasses
import math
import re

_DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
    "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3": 1, "f8e8m0fnu": 1, "s16": 2, "u16": 2,
    "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
    "c64": 8, "c128": 16,
}  # fmt: skip
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")


def array_shapes(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """'(bf16[1,4096]{1,0}, s32[])' -> [('bf16', (1, 4096)), ('s32', ())]."""
    return [
        (t, tuple(int(d) for d in dims.split(",") if d))
        for t, dims in _ARRAY.findall(shape)
        if t in _DTYPE_BYTES
    ]


def shape_bytes(shape: str) -> int:
    return int(sum(_DTYPE_BYTES[t] * math.prod(d) for t, d in array_shapes(shape)))


@dataclasses.dataclass
class Instruction:
    name: str
    shape: str  # the result type as printed
    opcode: str
    operands: list[str]
    attrs: str  # everything after the operands
    args: str = ""  # the text inside the parentheses (a parameter's number, a constant)


def split_top(text: str) -> list[str]:
    """Splits at commas not inside (), {} or []."""
    out, depth, cur = [], 0, []
    for ch in text:
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket group opening at text[start]."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] in "({[":
            depth += 1
        elif text[i] in ")}]":
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError(f"unbalanced: {text[start : start + 80]!r}")


def parse_instruction(line: str) -> Instruction | None:
    m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = ", line)
    if not m:
        return None
    rest = line[m.end() :]
    if rest.startswith("("):
        end = _balanced(rest, 0)
        shape, rest = rest[:end], rest[end:].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    op = re.match(r"([\w\-]+)\(", rest)
    if not op:
        return None
    end = _balanced(rest, op.end() - 1)
    # an operand prints as %name, after a /*index=5*/ comment every fifth
    operands = re.findall(r"%([\w.\-]+)", rest[op.end() : end - 1])
    args = rest[op.end() : end - 1]
    return Instruction(m.group(1), shape, op.group(1), operands, rest[end:], args)


def parse_module(hlo: str) -> tuple[dict[str, list[Instruction]], str]:
    """HLO module text -> ({computation name: instructions in order}, entry computation name)."""
    comps, entry, current = {}, None, None
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY )?%([\w.\-]+) \(.*\{\s*$", line)
        if head:
            current = head.group(2)
            comps[current] = []
            if head.group(1):
                entry = current
            continue
        if line.startswith("}"):
            current = None
            continue
        if current is not None:
            ins = parse_instruction(line)
            if ins:
                comps[current].append(ins)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


def attr(attrs: str, key: str) -> str | None:
    m = re.search(rf"\b{key}=%?([\w.\-]+)", attrs)
    return m.group(1) if m else None


def trip_count(ins: Instruction) -> int | None:
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', ins.attrs)
    return int(m.group(1)) if m else None


# --- the thunk sequence ---------------------------------------------------------------------------
@dataclasses.dataclass
class Thunk:
    id: int
    kind: str
    text: str  # the rest of the line (kernel name, grid, ...)
    children: list[Thunk] = dataclasses.field(default_factory=list)
    role: str = ""  # within a while: 'condition' | 'body'; within a conditional: the branch


def parse_thunks(text: str) -> list[Thunk]:
    """The thunk sequence dump -> a forest, nested by indentation."""
    roots: list[Thunk] = []
    stack: list[tuple[int, Thunk]] = []
    role = ""
    for line in text.splitlines():
        # (XLA prints an empty branch as "No thunks." with the next label on the same line)
        label = re.search(r"(condition|body|true_branch|false_branch|branch \d+):\s*$", line)
        if label and not re.match(r"^\s*\d+: k", line):
            role = label.group(1)
            continue
        m = re.match(r"^(\s*)(\d+): (k\w+)\s*(?:\[[^\]]*\])?\s*(.*)$", line)
        if not m:
            continue
        indent = len(m.group(1))
        thunk = Thunk(int(m.group(2)), m.group(3), m.group(4).strip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if stack:
            thunk.role = role
            stack[-1][1].children.append(thunk)
        else:
            roots.append(thunk)
        stack.append((indent, thunk))
    return roots
