"""Offline batch generation jobs: read rows, run them, write durable output rows, shard, merge.

Host code only (no jax). The pieces, in dataflow order:

    reader.read_input      input file -> InputRow list (each row validated on its own)
    sharding.shard_of      row key -> shard, by a stable hash (same on every host)
    resume.scan_output     what earlier runs finished (last row per key, torn-tail repair)
    writer.OutputWriter    lock, resume set, append + fsync per finished row, compaction
    errors                 output errors and the exit codes generate gives them
    job.run_job            rows -> llm.iter_generate -> output rows, in completion order
    summary                throughput, TTFT/TPOT percentiles, engine counters -> summary JSON
    merge.merge_outputs    shard outputs -> one file; missing / duplicated ids reported

`jaxserve.launch.generate` and `jaxserve.launch.merge` are the command lines over them.
"""

from jaxserve.batch.job import StopFlag, run_job
from jaxserve.batch.merge import MergeReport, merge_outputs
from jaxserve.batch.reader import InputRow, read_input, row_key
from jaxserve.batch.resume import scan_output
from jaxserve.batch.sharding import shard_of
from jaxserve.batch.writer import OutputWriter

__all__ = [
    "InputRow",
    "MergeReport",
    "OutputWriter",
    "StopFlag",
    "merge_outputs",
    "read_input",
    "row_key",
    "run_job",
    "scan_output",
    "shard_of",
]
