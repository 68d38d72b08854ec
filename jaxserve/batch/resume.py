"""Reading an existing output file for resume: which rows earlier runs finished.

    scan_output(path, repair) -> Resume   the last row of each key (fingerprint, failed); a torn
                                          last line (a crash artefact) cut off when `repair`
    Resume.plan(rows)         -> ResumePlan   rows to skip (done, unchanged), to redo (changed
                                          request or an error row), to run
    iter_output_rows(path)                every line with its offset; `merge` reads shards with it

A corrupt line that is not the last, or a complete line that is not an output row, is not a crash
artefact: NotAnOutput (this is not a jaxserve output; refuse rather than guess).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import stat
from collections.abc import Iterator
from typing import Any

from jaxserve.batch.errors import NotAnOutput
from jaxserve.batch.reader import row_key

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Resume:
    """What earlier runs left in the output file: the last row of each key."""

    rows: dict[str, tuple[str | None, bool]]  # key -> (fingerprint, is an error row)
    repaired_bytes: int  # size of the torn last line that was cut off (0: none)
    num_lines: int = 0  # complete rows in the file (> len(rows): superseded rows)

    @property
    def done_keys(self) -> set[str]:
        """Keys whose last row is not an error."""
        return {k for k, (_, failed) in self.rows.items() if not failed}

    @property
    def failed_keys(self) -> set[str]:
        return {k for k, (_, failed) in self.rows.items() if failed}

    def plan(self, rows: list[Any]) -> ResumePlan:
        """Which input rows are done: their last output row has their fingerprint and is not an
        error, or is the same input error (the same line fails the same way). Changed rows, and
        rows that failed in rendering or in the engine, are redone."""
        plan = ResumePlan(set(), [], [])
        for r in rows:
            got = self.rows.get(r.key)
            if got is None:
                continue
            fingerprint, failed = got
            if failed and r.error is not None and fingerprint == r.fingerprint:
                plan.skip.add(r.key)
            elif failed:
                plan.retried.append(r.key)
            elif r.fingerprint is None or fingerprint != r.fingerprint:
                plan.changed.append(r.key)
            else:
                plan.skip.add(r.key)
        return plan


@dataclasses.dataclass
class ResumePlan:
    skip: set[str]  # keys done with the same request: not run again
    changed: list[str]  # keys whose request changed since their row was written: redone
    retried: list[str]  # keys whose last row is an error: retried


def output_key(row: dict[str, Any]) -> str:
    """The key of an output row (same as its input row's `InputRow.key`)."""
    key = row.get("key")
    return key if isinstance(key, str) else row_key(row.get("id"), row.get("line"))


def is_output_row(row: Any) -> bool:
    return isinstance(row, dict) and "line" in row


def iter_output_rows(path: str) -> Iterator[tuple[int, int, bytes, dict[str, Any] | None]]:
    """Yields (line number, byte offset, raw line, row) for every line of an output file; a torn
    last line (no newline, or not JSON) comes last with row None. Raises NotAnOutput, naming the
    file and line, for anything else that is not an output row."""
    with open(path, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise NotAnOutput(f"output {path!r} is not a regular file")
        offset = 0
        bad = None  # (line number, offset, raw, problem) of an unparsable line: fatal unless last
        for number, raw in enumerate(f, start=1):
            if bad is not None:
                raise NotAnOutput(
                    f"{path!r} line {bad[0]} is corrupt ({bad[3]}) and is not the last line; "
                    "that is not a torn write from a crash, so it is not repaired"
                )
            try:
                row = json.loads(raw.decode("utf-8"))
            except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError
                if raw.endswith(b"\n"):  # a whole line: no torn write of ours ends with one
                    raise NotAnOutput(
                        f"{path!r} line {number} is not a jaxserve output row (not JSON: "
                        f"{type(e).__name__})"
                    ) from None
                bad = (number, offset, raw, f"not JSON: {type(e).__name__}")
            else:
                if not raw.endswith(b"\n"):  # parsed, but the write stopped before its newline
                    bad = (number, offset, raw, "no trailing newline")
                elif not is_output_row(row):
                    what = type(row).__name__ if not isinstance(row, dict) else "object"
                    raise NotAnOutput(
                        f"{path!r} line {number} is not a jaxserve output row (a JSON {what} "
                        "without 'line')"
                    )
                else:
                    yield number, offset, raw, row
            offset += len(raw)
        if bad is not None:
            yield bad[0], bad[1], bad[2], None


# Every output row is written as `json.dumps(row)` of a dict whose first key is "id" (batch/job.py),
# so a torn write of ours begins with these bytes (or is a prefix of them).
ROW_START = b'{"id": '


def _ours(torn: bytes) -> bool:
    return torn.startswith(ROW_START) or ROW_START.startswith(torn)


def scan_output(path: str, repair: bool) -> Resume:
    """Reads the rows in `path` (streaming, last row per key); with `repair`, truncates a torn
    last line. Raises NotAnOutput when the file is not a jaxserve output.

    A torn last line is repaired only in a file this job can show it wrote: one holding a
    complete output row, or whose only line begins as an output row does. A file of one
    unterminated line of anything else (a note, an empty-looking block) is not ours to cut."""
    rows: dict[str, tuple[str | None, bool]] = {}
    if not os.path.exists(path):
        return Resume(rows, 0)
    num_lines, torn_at, size = 0, None, 0
    for _, offset, raw, row in iter_output_rows(path):
        size = offset + len(raw)
        if row is None:
            if num_lines == 0 and not _ours(raw):
                raise NotAnOutput(
                    f"{path!r} holds no jaxserve output row, and its only line ({len(raw)} "
                    "bytes, no newline) does not begin as one: it is not a jaxserve output, so "
                    "it is not cut; give another --output, or --overwrite to replace it"
                )
            torn_at = offset
            continue
        num_lines += 1
        rows.pop(output_key(row), None)  # re-insert: dict order = order of the last rows
        fp = row.get("fingerprint")
        rows[output_key(row)] = (fp if isinstance(fp, str) else None, row.get("error") is not None)
    repaired = 0
    if torn_at is not None:
        repaired = size - torn_at
        if repair:
            with open(path, "r+b") as f:
                f.truncate(torn_at)
                f.flush()
                os.fsync(f.fileno())
            log.warning("%s: cut off a torn last line (%d bytes) left by a crash", path, repaired)
    return Resume(rows, repaired, num_lines)
