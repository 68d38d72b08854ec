"""Joins the output files of a sharded job and checks that every row is there exactly once.

Dataflow:

    shard outputs a.jsonl, b.jsonl, ...  -> rows keyed like the input (each row's `key`)
      -> within one file the LAST row of a key wins (a rerun that redid a row appended it; a
         finished run compacts them away); across files the first file's row is kept and the
         key is reported as duplicated
      -> with the job's input: ordered by input line; keys absent from every shard -> missing,
         keys that the input does not have -> unexpected
      -> merged JSONL written atomically (temp file + rename) + MergeReport

A torn last line in a shard (the shard was killed and not rerun) is left out and reported; its row
then shows up as missing. A line that is not an output row (`[1, 2]`, `"x"`, corrupt bytes before
the last line) raises ValueError naming the file and line.
"""

from __future__ import annotations

import dataclasses
import os

from jaxserve.batch.reader import read_input
from jaxserve.batch.resume import iter_output_rows, output_key


@dataclasses.dataclass
class MergeReport:
    rows_written: int
    num_failed: int  # merged rows that carry an `error` (bad input rows; not a merge problem)
    missing: list[str]  # keys of input rows found in no shard (only with an expected input)
    duplicated: dict[str, int]  # key -> number of occurrences (> 1) across all shards
    unexpected: list[str]  # keys found in shards but not in the expected input
    torn: list[str]  # shard files whose torn last line was left out

    @property
    def ok(self) -> bool:
        return not (self.missing or self.duplicated or self.unexpected)


def merge_outputs(
    inputs: list[str], output: str, expected_input: str | None = None, input_format: str = "auto"
) -> MergeReport:
    """Merges `inputs` into `output`; see the module docstring."""
    for path in inputs:
        if not os.path.isfile(path):
            raise ValueError(f"shard output {path!r} does not exist")
    if os.path.abspath(output) in {os.path.abspath(p) for p in inputs}:
        raise ValueError(f"--output {output!r} is also one of the inputs")
    rows: dict[str, bytes] = {}
    failed: dict[str, bool] = {}
    counts: dict[str, int] = {}
    torn = []
    for path in inputs:
        last: dict[str, tuple[bytes, bool]] = {}  # this file's last row of each key
        for _, _, raw, row in iter_output_rows(path):
            if row is None:
                torn.append(path)  # the torn last line: left out
                continue
            key = output_key(row)
            last.pop(key, None)
            last[key] = (raw, row.get("error") is not None)
        for key, (raw, is_error) in last.items():
            counts[key] = counts.get(key, 0) + 1
            if key not in rows:
                rows[key] = raw
                failed[key] = is_error
    num_failed = sum(failed.values())

    order = list(rows)
    missing: list[str] = []
    unexpected: list[str] = []
    if expected_input is not None:
        expected = [r.key for r in read_input(expected_input, input_format=input_format)]
        expected_set = set(expected)
        missing = [k for k in expected if k not in rows]
        unexpected = [k for k in rows if k not in expected_set]
        order = [k for k in expected if k in rows] + unexpected

    tmp = f"{output}.tmp.{os.getpid()}"
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    with open(tmp, "wb") as f:
        for key in order:
            f.write(rows[key])
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, output)
    return MergeReport(
        rows_written=len(order),
        num_failed=num_failed,
        missing=missing,
        duplicated={k: c for k, c in counts.items() if c > 1},
        unexpected=unexpected,
        torn=torn,
    )
