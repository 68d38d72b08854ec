"""The batch job's output file: append-only JSONL, each row durable before the next one starts.

Dataflow:

    OutputWriter(path).open()
      -> scan the existing file: torn last line (no trailing newline, or not JSON) -> truncated away
      -> Resume(done_keys, failed_keys)              rows already written by an earlier run
    writer.write(row)  -> one os.write of `json + "\\n"` on an O_APPEND fd, then fsync
    writer.close()

A crash (SIGKILL, preemption, power loss) can leave at most the last line partly written, because
each row is one append followed by fsync; `open()` detects that line and cuts it off, so a rerun
with the same output skips exactly the rows that finished and redoes the rest. A corrupt line that
is not the last one is not a crash artefact, and `open()` refuses to guess (ValueError).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

from jaxserve.batch.reader import row_key

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Resume:
    """What an earlier run left in the output file."""

    done_keys: set[str]  # every row in the file
    failed_keys: set[str]  # the rows among them that carry an `error`
    repaired_bytes: int  # size of the torn last line that was cut off (0: none)


def output_key(row: dict[str, Any]) -> str:
    """The key of an output row (same as its input row's `InputRow.key`)."""
    return row_key(row.get("id"), row.get("line"))


def check_output_path(path: str) -> None:
    """Raises ValueError unless `path` can be appended to (creating its directory if needed).

    Called before the model loads, so a bad --output fails in a second, not after minutes.
    """
    if os.path.isdir(path):
        raise ValueError(f"output {path!r} is a directory; give a .jsonl file path")
    parent = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create output directory {parent!r}: {e.strerror}") from None
    try:
        with open(path, "ab"):
            pass
    except OSError as e:
        raise ValueError(
            f"output directory {parent!r} is not writable ({path!r}: {e.strerror})"
        ) from None


def scan_output(path: str, repair: bool) -> Resume:
    """Reads the rows in `path` (streaming); with `repair`, truncates a torn last line."""
    done: set[str] = set()
    failed: set[str] = set()
    if not os.path.exists(path):
        return Resume(done, failed, 0)
    offset = 0  # byte offset of the current line's start
    bad = None  # (line number, offset, problem) of an unparsable line; fatal unless it is the last
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if bad is not None:
                raise ValueError(
                    f"output {path!r} line {bad[0]} is corrupt ({bad[2]}) and is not the last "
                    "line; that is not a torn write from a crash, so it is not repaired"
                )
            try:
                row = json.loads(raw.decode("utf-8"))
                if not isinstance(row, dict) or "line" not in row:
                    raise ValueError("not an output row")
                if not raw.endswith(b"\n"):  # parsed, but the write stopped before its newline
                    raise ValueError("no trailing newline")
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                bad = (number, offset, e)
            else:
                done.add(output_key(row))
                if row.get("error") is not None:
                    failed.add(output_key(row))
            offset += len(raw)
    repaired = 0
    if bad is not None:
        repaired = offset - bad[1]
        if repair:
            with open(path, "r+b") as f:
                f.truncate(bad[1])
                f.flush()
                os.fsync(f.fileno())
            log.warning("%s: cut off a torn last line (%d bytes) left by a crash", path, repaired)
    return Resume(done, failed, repaired)


class OutputWriter:
    """Appends output rows to `path`; each `write` is on disk (fsync) when it returns."""

    def __init__(self, path: str, fsync: bool = True):
        self.path = path
        self.fsync = fsync
        self._fd: int | None = None

    def open(self) -> Resume:
        """Repairs a torn last line, opens for append, and returns the rows already done."""
        resume = scan_output(self.path, repair=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if self.fsync:  # make the file's directory entry durable too
            dir_fd = os.open(os.path.dirname(os.path.abspath(self.path)), os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        return resume

    def write(self, row: dict[str, Any]) -> None:
        if self._fd is None:
            raise ValueError("OutputWriter.write before open()")
        data = (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8")
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]
        if self.fsync:
            os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> OutputWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
