"""Joins the outputs of a sharded generate job and reports ids missing or duplicated.

    python -m jaxserve.launch.merge --inputs out/shard-0.jsonl,out/shard-1.jsonl \\
        --output out/all.jsonl [--expected_input prompts.jsonl]

With --expected_input the merged rows follow the input's order and every input row must appear
exactly once. Within one shard file the last row of an id wins (a rerun that redid a row appended
it). Exit status: 0 when nothing is missing, duplicated or unexpected; 1 otherwise (the merged file
is still written, keeping each id's row from the first file that has it); 2 for bad arguments or a
shard holding a line that is not an output row (named by file and line).
"""

from __future__ import annotations

import sys

from absl import app, flags

from jaxserve.batch.merge import merge_outputs
from jaxserve.batch.reader import INPUT_FORMATS

FLAGS = flags.FLAGS
SHOW = 20  # ids listed per problem in the report

flags.DEFINE_list("inputs", None, "Comma-separated shard output files (JSONL) to join.")
flags.DEFINE_string("output", None, "Merged JSONL output file.")
flags.DEFINE_string(
    "expected_input",
    None,
    "The job's --input file: report its rows missing from every shard, ordering by its lines.",
)
flags.DEFINE_enum("input_format", "auto", list(INPUT_FORMATS), "Format of --expected_input.")


def _listing(keys: list[str]) -> str:
    more = f" ... and {len(keys) - SHOW} more" if len(keys) > SHOW else ""
    return ", ".join(keys[:SHOW]) + more


def main(argv: list[str]) -> int:
    if len(argv) > 1 or not FLAGS.inputs or not FLAGS.output:
        print("merge: error: give --inputs a.jsonl,b.jsonl and --output all.jsonl", file=sys.stderr)
        return 2
    try:
        report = merge_outputs(
            FLAGS.inputs, FLAGS.output, FLAGS.expected_input, input_format=FLAGS.input_format
        )
    except ValueError as e:
        print(f"merge: error: {e}", file=sys.stderr)
        return 2
    print(
        f"merge: {report.rows_written} rows from {len(FLAGS.inputs)} files -> {FLAGS.output} "
        f"({report.num_failed} failed rows among them)"
    )
    for path in report.torn:
        print(f"merge: warning: {path} ends with a torn line (left out); rerun that shard")
    if report.missing:
        print(f"merge: MISSING {len(report.missing)} ids: {_listing(report.missing)}")
    if report.duplicated:
        dup = [f"{k} (x{c})" for k, c in report.duplicated.items()]
        print(f"merge: DUPLICATED {len(dup)} ids (first row kept): {_listing(dup)}")
    if report.unexpected:
        print(
            f"merge: UNEXPECTED {len(report.unexpected)} ids not in --expected_input: "
            f"{_listing(report.unexpected)}"
        )
    return 0 if report.ok else 1


if __name__ == "__main__":
    app.run(main)
