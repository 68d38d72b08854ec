"""The batch job's output file: append-only JSONL, each row durable before the next one starts.

Dataflow:

    check_output_path(output, input)   before the model loads: a regular file (or none yet), not the
                                       input (same st_dev/st_ino: also via a symlink or hard link)
    OutputWriter(path).open()
      -> lock <realpath>.lock (fcntl.flock, exclusive, non-blocking; it holds the owner's pid):
         a second writer of the same output fails at once (OutputLocked, naming that pid)
      -> scan the existing file: not a jaxserve output -> refused (unless overwrite: emptied);
         torn last line (no trailing newline, or not JSON) of a file this job wrote (it holds an
         output row, or the line begins as one) -> truncated away
      -> Resume(rows: key -> (fingerprint, failed))   the last row of each key an earlier run wrote
         (`resume.py` reads the file; `errors.py` holds the errors and exit codes)
    writer.write(row)  -> one os.write of `json + "\\n"` on an O_APPEND fd, then fsync
    writer.compact()   -> the file rewritten with the last row of each key, each row's `line`
                          that of its input row now (temp file + rename)
    writer.close()     -> the lock released

A crash (SIGKILL, preemption, power loss, disk full) can leave at most the last line partly
written (with no newline: each row is one append of `json + "\n"` followed by fsync); `open()`
detects that line and cuts it off, so a rerun with the same output skips exactly the rows that finished and redoes the rest. A
corrupt line that is not the last one, or a complete line that is not an output row, is not a crash
artefact, and `open()` refuses to guess (NotAnOutput).

One row per key, at every instant: before a rerun appends anything, it drops the rows it is about to
redo (their request changed, or they were errors) with `compact(drop=...)`, which writes a new
file and renames it over the old (a reader sees the old file or the new, never a torn one); every
row it then appends is of a key the file does not hold. A run that finishes compacts again (its
rows' `line` numbers, rows no longer in the input). Readers (`scan_output`, `merge`) still take the
last row of each key, which also reads files older versions left with superseded rows.

OS errors on the output (disk full, file too large, permission) raise OutputError with an exit
code (see `jaxserve.launch.generate`).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import stat
from typing import Any

from jaxserve.batch.errors import (
    ERRNO_EXIT,
    EXIT_BAD_OUTPUT,
    EXIT_IO,
    OutputError,
    OutputLocked,
    os_error,
)
from jaxserve.batch.resume import Resume, iter_output_rows, output_key, scan_output

log = logging.getLogger(__name__)


def same_file(a: str, b: str) -> bool:
    """True when both paths exist and name one file (also through symlinks and hard links)."""
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def check_output_path(path: str, input_path: str | None = None) -> None:
    """Raises OutputError unless `path` can be appended to (creating its directory if needed).

    Called before the model loads, so a bad --output fails in a second, not after minutes.
    """
    if os.path.isdir(path):
        raise OutputError(f"output {path!r} is a directory; give a .jsonl file path")
    if os.path.exists(path):
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise OutputError(f"output {path!r} is not a regular file ({_kind(mode)}); refused")
        if input_path is not None and same_file(path, input_path):
            raise OutputError(f"output {path!r} is the input file {input_path!r}; refused")
    parent = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        code = ERRNO_EXIT.get(e.errno, (EXIT_BAD_OUTPUT, ""))[0]
        raise OutputError(
            f"cannot create output directory {parent!r}: {e.strerror}", code
        ) from None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o644)
        os.close(fd)
    except OSError as e:
        code = ERRNO_EXIT.get(e.errno, (EXIT_IO, ""))[0]
        raise OutputError(
            f"output directory {parent!r} is not writable ({path!r}: {e.strerror})", code
        ) from None


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a plain file"


def encode_row(row: dict[str, Any]) -> bytes:
    """One output line, always valid UTF-8: a string the model or input holds that UTF-8 cannot
    encode (a lone surrogate) is written as a JSON \\u escape instead. Raises TypeError /
    ValueError for a value JSON cannot hold."""
    text = json.dumps(row, ensure_ascii=False)
    try:
        return (text + "\n").encode("utf-8")
    except UnicodeEncodeError:
        return (json.dumps(row, ensure_ascii=True) + "\n").encode("ascii")


class OutputWriter:
    """Appends output rows to `path` under an exclusive lock; each `write` is on disk (fsync)
    when it returns."""

    def __init__(self, path: str, fsync: bool = True, overwrite: bool = False):
        self.path = path
        self.fsync = fsync
        self.overwrite = overwrite
        self.lock_path = os.path.realpath(path) + ".lock"
        self._fd: int | None = None
        self._lock_fd: int | None = None

    def open(self) -> Resume:
        """Locks, repairs a torn last line, opens for append, and returns the rows already done."""
        self._lock()
        try:
            if self.overwrite and os.path.exists(self.path):
                os.truncate(self.path, 0)
            resume = scan_output(self.path, repair=True)
            self._open_append()
        except OSError as e:
            self.close()
            raise os_error(self.path, e, "opening") from None
        except BaseException:
            self.close()
            raise
        return resume

    def _lock(self) -> None:
        try:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK, 0o644)
        except OSError as e:
            raise os_error(self.lock_path, e, "creating the lock file of") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OutputError(f"lock file {self.lock_path!r} is not a regular file")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
                raise OutputLocked(
                    f"output {self.path!r} is being written by another running job (pid "
                    f"{holder}, lock {self.lock_path!r}); two writers would duplicate rows. "
                    "Wait for it to finish or stop it, then rerun."
                ) from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self._lock_fd = fd

    def _open_append(self) -> None:
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if self.fsync:  # make the file's directory entry durable too
            _fsync_dir(self.path)

    def write(self, row: dict[str, Any]) -> None:
        """Appends one row. Raises TypeError/ValueError (nothing written) for a row JSON cannot
        hold, OutputError for an OS error (disk full, file too large, permission)."""
        if self._fd is None:
            raise ValueError("OutputWriter.write before open()")
        data = encode_row(row)
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
            if self.fsync:
                os.fsync(self._fd)
        except OSError as e:
            raise os_error(self.path, e) from None

    def compact(
        self,
        drop_errors_of: set[str] | None = None,
        lines: dict[str, int] | None = None,
        drop: set[str] | None = None,
    ) -> int:
        """Rewrites the file with the last row of each key (the order of those rows kept),
        atomically (temp file + rename); with `drop_errors_of`, also drops the error rows of
        those keys (rows no longer in the input); with `drop`, every row of those keys (the rows
        a run is about to redo: dropped before it appends their new rows, so the file never
        holds two rows of one key); with `lines` (key -> input line), a row done before lines
        moved gets its current `line`. Returns the number of rows removed."""
        if self._fd is None:
            raise ValueError("OutputWriter.compact before open()")
        last: dict[str, tuple[int, bytes, bool]] = {}
        total, moved = 0, False
        for number, _, raw, row in iter_output_rows(self.path):
            if row is None:
                continue
            total += 1
            key = output_key(row)
            if lines is not None and key in lines and row.get("line") != lines[key]:
                row["line"] = lines[key]
                raw, moved = encode_row(row), True
            last[key] = (number, raw, row.get("error") is not None)
        keep = sorted(
            (
                v
                for k, v in last.items()
                if not (v[2] and drop_errors_of and k in drop_errors_of) and k not in (drop or ())
            ),
            key=lambda v: v[0],
        )
        removed = total - len(keep)
        if removed == 0 and not moved:
            return 0
        target = os.path.realpath(self.path)  # a symlinked output stays a symlink
        tmp = f"{target}.compact.{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                for _, raw, _ in keep:
                    f.write(raw)
                f.flush()
                os.fsync(f.fileno())
            os.close(self._fd)
            self._fd = None
            os.replace(tmp, target)
            self._open_append()
        except OSError as e:
            if os.path.exists(tmp):
                os.unlink(tmp)
            if self._fd is None:
                self._open_append()
            raise os_error(self.path, e, "compacting") from None
        return removed

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock; the file stays (removing it races)
            self._lock_fd = None

    def __enter__(self) -> OutputWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _fsync_dir(path: str) -> None:
    dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class FollowerOutput:
    """What a multi-host run's other processes hold instead of an `OutputWriter`: process 0
    alone writes the output (`launch/distributed.py`); the others read the same resume state
    (after process 0 has locked and repaired the file) and write nothing."""

    def __init__(self, path: str):
        self.path = path

    def open(self) -> Resume:
        try:
            return scan_output(self.path, repair=False)
        except OSError as e:
            raise os_error(self.path, e, "reading") from None

    def write(self, row: dict[str, Any]) -> None:
        encode_row(row)  # the same TypeError/ValueError as the writer's, so every process agrees

    def compact(self, drop_errors_of=None, lines=None) -> int:
        return 0

    def close(self) -> None:
        pass
