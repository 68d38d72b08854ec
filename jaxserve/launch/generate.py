"""Offline batch generation over a file of prompts: resumable, per-row errors, shardable.

    python -m jaxserve.launch.generate --input prompts.jsonl --output out/results.jsonl \\
        [--num_shards N --shard_index i] [--max_tokens 256 --temperature 0 ...] [--flagfile f]

Dataflow:

    check --input exists and --output is a regular file (or new) and not the input
                                                         (fails in a second, before the model)
    read + validate every row (jaxserve.batch.reader)    bad rows carry "line N: <problem>"
    keep this shard's rows (stable hash of each row's key)
    lock --output (<output>.lock), scan it: cut a torn last line; skip rows done with the same
      request fingerprint; redo rows whose prompt or parameters changed (warning) and error rows
    load the model -> run_job: iter_generate, each finished row appended + fsync'd
    finished: compact --output to one row per key (superseded rows dropped)
    write <output>.summary.json

Input rows (JSONL): {"id": ..., "prompt" | "messages" | "prompt_token_ids": ..., optional
SamplingParams fields such as "max_tokens", "temperature", "seed", "stop", and "lora": the name
of an adapter given with --enable_lora --lora_modules name=path}; or a plain text file,
one prompt per line, id = a hash of the line's content (plus "#k" for its k-th repeat), so
inserting a line moves no answer. The sampling flags below are the defaults for every row.
A row without a "seed" samples with one derived from --seed (0 when unset) and its key, so sampled
outputs do not depend on sharding, order or restarts.

Exit codes:
    0    done (every row has an output row; bad rows carry their error)
    1    an unexpected internal error (a traceback)
    2    bad arguments, or an --output refused: it is the --input file (also through a symlink or
         hard link; always refused), not a regular file (/dev/full, a FIFO), or an existing file
         that is not a jaxserve output (refused unless --overwrite)
    3    --output is locked by another running job (its pid is named); nothing was written
    4    disk full (ENOSPC, EDQUOT) while writing --output
    5    file too large (EFBIG, e.g. `ulimit -f`) while writing --output
    6    permission denied / read-only file system on --output
    7    another OS error on --output
    130  interrupted by SIGINT; 143 by SIGTERM
For 3-7 and 130/143 every row written before is saved: rerun the same command to resume.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from absl import app, flags

from jaxserve.batch.errors import OutputError
from jaxserve.batch.job import StopFlag, run_job
from jaxserve.batch.reader import INPUT_FORMATS, check_input_path, read_input
from jaxserve.batch.sharding import check_shards, shard_of
from jaxserve.batch.summary import JobStats, summary, summary_path, write_summary
from jaxserve.batch.writer import FollowerOutput, OutputWriter, check_output_path
from jaxserve.config import EngineConfig
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.launch import distributed
from jaxserve.launch import flags as engine_flags
from jaxserve.lora.request import lora_requests

FLAGS = flags.FLAGS
log = logging.getLogger("jaxserve.generate")

flags.DEFINE_string(
    "input", None, "Input file: JSONL rows, or plain text with one prompt per line."
)
flags.DEFINE_string(
    "output",
    None,
    "Output JSONL, one row per input row (appended as rows finish; rerun with the same path to "
    "resume). The summary JSON is written beside it as <output>.summary.json.",
)
flags.DEFINE_enum(
    "input_format",
    "auto",
    list(INPUT_FORMATS),
    "auto: .jsonl/.json = JSONL, .txt = text, else sniffed.",
)
flags.DEFINE_integer(
    "num_shards", 1, "Split the input into this many shards (by id).", lower_bound=1
)
flags.DEFINE_integer(
    "shard_index", 0, "Which shard this process runs, in [0, num_shards).", lower_bound=0
)
_SP = SamplingParams()
flags.adopt_module_key_flags(engine_flags)  # --help lists the shared engine flags too
flags.DEFINE_integer(
    "max_tokens", None, f"Default max output tokens per row. Unset: {_SP.max_tokens}."
)
flags.DEFINE_float(
    "temperature", None, f"Default temperature; 0 = greedy. Unset: {_SP.temperature}."
)
flags.DEFINE_float("top_p", None, f"Default nucleus sampling mass, in (0, 1]. Unset: {_SP.top_p}.")
flags.DEFINE_integer("top_k", None, "Default top-k; 0 or -1 = off. Unset: off.")
flags.DEFINE_float("min_p", None, "Default min-p, in [0, 1]. Unset: 0 (off).")
flags.DEFINE_float("repetition_penalty", None, "Default repetition penalty. Unset: 1.0 (off).")
flags.DEFINE_multi_string("stop", None, "Default stop string (repeat the flag for several).")
flags.DEFINE_integer(
    "logprobs", None, "Write the top-n log-probs of each generated token (n <= 20)."
)
flags.DEFINE_bool("ignore_eos", None, "Keep generating past EOS (until max_tokens).")
flags.DEFINE_bool("output_token_ids", False, "Write the generated token ids of each row.")
flags.DEFINE_bool(
    "use_chat_template",
    False,
    "Wrap each plain 'prompt' in a user message and apply the model's chat template "
    "('messages' rows always use it).",
)
flags.DEFINE_bool("progress", True, "Show a tqdm progress bar (finished rows, tokens/s).")
flags.DEFINE_bool("print_outputs", False, "Print each finished row's id and text as it finishes.")
flags.DEFINE_bool("fsync", True, "fsync the output after every row (off: faster, not crash-safe).")
flags.DEFINE_bool(
    "overwrite",
    False,
    "Empty an existing --output first (also one that is not a jaxserve output) instead of "
    "resuming it. Never allowed when --output is the --input file.",
)

SAMPLING_FLAGS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "stop",
    "logprobs",
    "ignore_eos",
)


def sampling_defaults() -> dict[str, Any]:
    """The sampling flags that were set, as SamplingParams fields."""
    return {name: FLAGS[name].value for name in SAMPLING_FLAGS if FLAGS[name].value is not None}


def make_llm(**kwargs):
    """Loads the model (imported here so bad arguments fail before jax starts)."""
    from jaxserve.llm import LLM

    return LLM(**kwargs)


def _fail(message: str, code: int = 2) -> int:
    print(f"generate: error: {message}", file=sys.stderr)
    return code


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        return _fail(f"unexpected arguments {argv[1:]}")
    if not FLAGS.input or not FLAGS.output:
        return _fail("--input and --output are required")
    try:
        check_shards(FLAGS.num_shards, FLAGS.shard_index)
        check_input_path(FLAGS.input)
        check_output_path(FLAGS.output, FLAGS.input)
        defaults = sampling_defaults()
        SamplingParams.from_dict(defaults)  # a bad flag fails here, not once per row
        llm_kwargs = engine_flags.llm_kwargs()
        loras = lora_requests(engine_flags.lora_modules())
        distributed.wanted()  # the multi-host flags go together
    except OutputError as e:
        return _fail(str(e), e.exit_code)
    except (ValueError, OverflowError) as e:
        return _fail(str(e))
    distributed.initialize()
    stop = StopFlag()
    with stop.installed():
        return _run(defaults, llm_kwargs, stop, loras)


def _run(defaults: dict[str, Any], llm_kwargs: dict[str, Any], stop: StopFlag, loras: dict) -> int:
    base_seed = EngineConfig(**llm_kwargs).seed  # --seed, else the engine's default
    rows = read_input(
        FLAGS.input,
        input_format=FLAGS.input_format,
        sampling_defaults=defaults,
        base_seed=base_seed,
        use_chat_template=FLAGS.use_chat_template,
    )
    rows = [r for r in rows if shard_of(r.key, FLAGS.num_shards) == FLAGS.shard_index]
    leader = distributed.is_writer()  # process 0 alone writes (one process: always)
    if leader:
        writer = OutputWriter(FLAGS.output, fsync=FLAGS.fsync, overwrite=FLAGS.overwrite)
    else:
        writer = FollowerOutput(FLAGS.output)
    error = None
    if leader:
        try:
            resume = writer.open()
        except OutputError as e:
            error = e
    # the others read the output after process 0 has locked and repaired it, and stop if it failed
    code = distributed.agree(error.exit_code if error is not None else 0)
    if error is not None:
        return _fail(str(error), error.exit_code)
    if code:
        return _fail(f"process 0 could not open --output (exit code {code})", code)
    if not leader:
        try:
            resume = writer.open()
        except OutputError as e:
            return _fail(str(e), e.exit_code)
    plan = resume.plan(rows)
    done_before = len(plan.skip)
    failed_before = sum(r.key in plan.skip for r in rows if r.error is not None)
    repaired = resume.repaired_bytes
    log.info(
        "%s: %d rows in shard %d/%d, %d already done%s",
        FLAGS.input,
        len(rows),
        FLAGS.shard_index,
        FLAGS.num_shards,
        done_before,
        f" (cut off a torn last line of {repaired} bytes)" if repaired else "",
    )
    if plan.changed:
        log.warning(
            "%d rows changed (prompt or parameters) since their output was written; redoing "
            "them (the old rows are superseded): %s",
            len(plan.changed),
            _listing(plan.changed),
        )
    if plan.retried:
        log.warning(
            "retrying %d rows that failed before: %s", len(plan.retried), _listing(plan.retried)
        )
    if leader and (plan.changed or plan.retried):
        try:  # their old rows go first: the file never holds two rows of one key
            writer.compact(drop=set(plan.changed) | set(plan.retried))
        except OutputError as e:
            writer.close()
            return _fail(str(e), e.exit_code)

    stats, llm, load_s, code = JobStats(), None, None, 0
    try:
        if done_before < len(rows) and not stop.requested:
            if any(r.error is None and r.key not in plan.skip for r in rows):
                t0 = time.monotonic()
                llm = make_llm(**llm_kwargs)  # only bad rows left to write: no model needed
                load_s = time.monotonic() - t0
            run_job(
                llm,
                rows,
                writer,
                done_keys=plan.skip,
                tokenizer=llm.get_tokenizer() if llm is not None else None,
                use_chat_template=FLAGS.use_chat_template,
                output_token_ids=FLAGS.output_token_ids,
                stop=stop,
                progress=FLAGS.progress,
                print_outputs=FLAGS.print_outputs,
                stats=stats,
                loras=loras,
            )
        if not stop.requested:  # finished: one row per key in the file
            keys = {r.key for r in rows}
            stale_errors = {k for k in resume.failed_keys if k not in keys}
            removed = writer.compact(
                drop_errors_of=stale_errors, lines={r.key: r.line for r in rows}
            )
            if removed:
                log.info("%s: compacted, %d superseded rows removed", FLAGS.output, removed)
    except KeyboardInterrupt:  # a second signal: stop now; every row written so far is on disk
        pass
    except OutputError as e:
        code = _fail(str(e), e.exit_code)
    finally:
        writer.close()

    result = summary(
        stats,
        rows_in_shard=len(rows),
        rows_done_before=done_before,
        ok_before=done_before - failed_before,
        failed_before=failed_before,
        interrupted=stop.name,
        engine_stats=llm.stats() if llm is not None else None,
        extra={
            "input": FLAGS.input,
            "output": FLAGS.output,
            "num_shards": FLAGS.num_shards,
            "shard_index": FLAGS.shard_index,
            "model": llm.source if llm is not None else llm_kwargs.get("model"),
            "model_load_s": load_s,
            "sampling_defaults": defaults,
            "redone_changed": len(plan.changed),
            "retried_errors": len(plan.retried),
            "output_error": code or None,
        },
    )
    if code == 0:
        result["complete"] = result["complete"] and not stop.requested
    else:
        result["complete"] = False
    try:
        if leader:
            write_summary(summary_path(FLAGS.output), result)
    except OSError as e:
        print(f"generate: warning: could not write the summary: {e}", file=sys.stderr)
    if code:
        return code
    rows_summary, run = result["rows"], result["this_run"]
    if stop.requested:
        print(
            f"generate: interrupted by {stop.name}: {stats.num_ok + stats.num_failed} rows "
            f"finished this run, {rows_summary['remaining']} remaining; every finished row is "
            f"saved in {FLAGS.output}. Rerun the same command to resume.",
            file=sys.stderr,
        )
        return 128 + stop.signum
    print(
        f"generate: {rows_summary['ok']} ok, {rows_summary['failed']} failed of "
        f"{rows_summary['in_shard']} rows -> {FLAGS.output} ({run['rows_per_s']:.2f} rows/s, "
        f"{run['completion_tokens_per_s']:.1f} tok/s this run)",
        file=sys.stderr,
    )
    return 0


def _listing(keys: list[str], show: int = 10) -> str:
    more = f" ... and {len(keys) - show} more" if len(keys) > show else ""
    return ", ".join(keys[:show]) + more


if __name__ == "__main__":
    app.run(main)
