"""The check an `EngineConfig` field declares beside its default, and the loop that runs them.

A field is `setting(default, help, choices=None, check=..., group=...)`; `check` is one `Check`
or a tuple of them, run in order, and choices add `one_of(choices)` first; `group` names the
sub-config holding the field (`groups.py`). `run_checks(config)` runs every field's checks in
field order; the first value to fail raises

    ValueError: EngineConfig.<field> must be <check.what>, got <check.shown(value)>

    positive_int               a positive int (True is not an int here)
    int_at_least(-1, note)     an int >= -1 (note)
    an_int, a_bool, a_str      that type, exactly
    optional(check)            None, or what `check` takes ("... or None")
    power_of_two               after an int check (None passes: optional(...) decides it)
    one_of(choices)            one of a fixed set (the flag's enum)

Rules between fields (num_slots against data_parallel_size, ...) are the config's own, in its
__post_init__.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Check:
    """What a field's value must be: `ok(value)`, and the words the error uses."""

    what: str  # "<field> must be <what>": "a positive int"
    ok: Callable[[Any], bool]
    shown: Callable[[Any], str] = repr  # the bad value as the error shows it ("got <shown>")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def int_at_least(minimum: int, note: str | None = None) -> Check:
    """An int >= minimum; `note` (in parentheses) says what the smallest values mean."""
    what = f"an int >= {minimum}" + (f" ({note})" if note else "")
    return Check(what, lambda v: _is_int(v) and v >= minimum)


def optional(check: Check) -> Check:
    """None, or a value `check` takes."""
    return Check(f"{check.what} or None", lambda v: v is None or check.ok(v), check.shown)


def one_of(choices: tuple) -> Check:
    """One of a fixed set of values (a string field's choices)."""
    return Check(f"one of {choices}", lambda v: v in choices)


positive_int = Check("a positive int", lambda v: _is_int(v) and v >= 1)
an_int = Check("an int", _is_int)
a_bool = Check("a bool", lambda v: isinstance(v, bool))
a_str = Check("a str", lambda v: isinstance(v, str))
power_of_two = Check("a power of two", lambda v: v is None or not v & (v - 1), shown=str)


def setting(
    default: Any,
    text: str,
    choices: tuple[str, ...] | None = None,
    check: Check | tuple[Check, ...] = (),
    *,
    group: str,
) -> Any:
    """A config field: its default, its help text (which the launch flags show), for a string
    picked from a fixed set the choices (checked, and offered as the flag's enum), the checks
    its value must pass (`run_checks`), and the group of settings it belongs to: the sub-config
    of the engine's part that reads it (`groups.py`: "cache" -> `CacheConfig`)."""
    checks = (check,) if isinstance(check, Check) else tuple(check)
    metadata: dict[str, Any] = {"help": text, "group": group}
    if choices is not None:
        metadata["choices"] = choices
        checks = (one_of(choices), *checks)
    metadata["checks"] = checks
    return dataclasses.field(default=default, metadata=metadata)


def run_checks(config: Any) -> None:
    """Every field's declared checks, in field order; ValueError at the first value to fail."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        for check in f.metadata.get("checks", ()):
            if not check.ok(value):
                raise ValueError(
                    f"{type(config).__name__}.{f.name} must be {check.what}, "
                    f"got {check.shown(value)}"
                )
