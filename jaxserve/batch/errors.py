"""The batch job's output errors and the exit codes `generate` gives them (BUILD.md lists them).

A leaf module: the reader of an existing output (`resume.py`) and the writer both raise these.
"""

from __future__ import annotations

import errno

# Exit codes of `generate` for output problems (also documented there and in BUILD.md).
EXIT_BAD_OUTPUT = 2  # refused: the input itself, not a jaxserve output, not a regular file
EXIT_LOCKED = 3  # another running job holds the output's lock
EXIT_DISK_FULL = 4  # ENOSPC / EDQUOT
EXIT_FILE_TOO_LARGE = 5  # EFBIG (a file size limit, ulimit -f)
EXIT_PERMISSION = 6  # EACCES / EPERM / EROFS
EXIT_IO = 7  # any other OS error on the output

ERRNO_EXIT = {
    errno.ENOSPC: (EXIT_DISK_FULL, "disk full"),
    errno.EDQUOT: (EXIT_DISK_FULL, "disk quota exceeded"),
    errno.EFBIG: (EXIT_FILE_TOO_LARGE, "file too large (a file size limit, e.g. ulimit -f)"),
    errno.EACCES: (EXIT_PERMISSION, "permission denied"),
    errno.EPERM: (EXIT_PERMISSION, "operation not permitted"),
    errno.EROFS: (EXIT_PERMISSION, "read-only file system"),
}


class OutputError(ValueError):
    """The output cannot be used or written; `exit_code` tells the command line what to return."""

    def __init__(self, message: str, exit_code: int = EXIT_BAD_OUTPUT):
        super().__init__(message)
        self.exit_code = exit_code


class OutputLocked(OutputError):
    def __init__(self, message: str):
        super().__init__(message, EXIT_LOCKED)


class NotAnOutput(OutputError):
    """The file holds something that is not a jaxserve output (or is corrupt before its end)."""


def os_error(path: str, e: OSError, doing: str = "writing") -> OutputError:
    """An OSError on the output as an OutputError with a message and an exit code."""
    code, what = ERRNO_EXIT.get(e.errno, (EXIT_IO, e.strerror or str(e)))
    return OutputError(
        f"{doing} output {path!r} failed: {what} ([Errno {e.errno}] {e.strerror}); every row "
        "written before is saved: free space / fix the cause and rerun the same command to resume",
        code,
    )
