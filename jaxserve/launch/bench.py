r"""Offline serving benchmark: one built-in workload through `LLM.generate`, timed after warm-up.

    python -m jaxserve.launch.bench --model=tiny --load_format=dummy --workload=longtail \
        --batching=continuous --num_slots=32 --summary_json=/tmp/bench.json

Dataflow:
  1. `make_workload(--workload, vocab_size, --num_requests, --seed)`: token-id prompts with exact
     output lengths (greedy, `ignore_eos=True`, `max_tokens` = the drawn length).
  2. Build the `LLM` from the engine flags (`jaxserve.launch.flags`, one per `EngineConfig`
     field: `--batching`, `--num_slots`, ...); `--num_slots` overrides the workload's default slot
     count only when given. Load time is measured.
  3. Warm-up (unless `--nowarmup`: the engine flag is on by default here, and runs this step
     after the build rather than compiling inside it): `llm.warmup()` compiles every step variant,
     then one short batch fills every slot, so every prefill/decode shape the timed run can meet
     compiles here. JAX's backend-compile events are counted separately for warm-up and for the
     timed run (the latter should be 0).
  4. Timed run: `llm.generate(all prompts)`; wall time from submission to the last output.
  5. Summary: output tokens/s (and per CPU-second of this process, a figure less sensitive to
     other processes on a shared CPU) and the host loop's share of that CPU time (the calling
     thread: scheduling, dispatch, detokenizing; the rest is XLA's threads), requests/s, TTFT and TPOT p50/p90/p99 (from each output's
     `RequestMetrics`), mean slot occupancy and KV-page utilization (from `llm.stats()`), and the
     request timeline (first-token and finish times relative to submission) for occupancy plots.

The benchmark core (`run_benchmark`, the summary, `CompileCounter`) is `jaxserve/bench/core.py`;
experiments/ call it in one process. This file is the absl entry point only.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from absl import app, flags

from jaxserve.bench.core import format_table, make_llm, run_benchmark
from jaxserve.bench.workloads import SPECS, make_workload
from jaxserve.launch import distributed
from jaxserve.launch import flags as engine_flags

_WORKLOAD = flags.DEFINE_enum("workload", "longtail", sorted(SPECS), "Built-in workload to serve.")
_NUM_REQUESTS = flags.DEFINE_integer(
    "num_requests", None, "Override the workload's number of requests."
)
_SUMMARY_JSON = flags.DEFINE_string("summary_json", None, "Write the JSON summary to this path.")
flags.adopt_module_key_flags(engine_flags)  # --help lists the engine flags too


def engine_kwargs(fv: flags.FlagValues, workload: str) -> dict:
    """`LLM(**engine_kwargs(...))`: the engine flags as every launcher takes them, and the
    benchmark's one default of its own: the workload's slot count (--num_slots overrides it).
    --warmup is the benchmark's warm-up (step 3: on unless --nowarmup), not the engine's."""
    kwargs = engine_flags.llm_kwargs(fv)
    kwargs.pop("warmup", None)
    return {"num_slots": SPECS[workload].num_slots, **kwargs}


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    kwargs = engine_kwargs(flags.FLAGS, _WORKLOAD.value)
    distributed.initialize()  # a multi-host run: every process benchmarks the same workload
    do_warmup = flags.FLAGS.warmup is not False  # the benchmark's own warm-up (step 3)
    llm, load_s = make_llm(**kwargs)
    workload = make_workload(
        _WORKLOAD.value,
        llm.model_config.vocab_size,
        _NUM_REQUESTS.value,
        seed=llm.engine_config.seed,
    )
    if workload.max_seq_len > llm.engine_config.max_model_len:
        raise app.UsageError(
            f"--max_model_len={llm.engine_config.max_model_len} is below the workload's longest "
            f"sequence ({workload.max_seq_len} tokens)"
        )
    result = run_benchmark(llm, workload, do_warmup=do_warmup)
    summary = {
        "workload": workload.name,
        "workload_description": workload.description,
        "batching": llm.engine_config.batching,
        "num_slots": llm.engine_config.num_slots,
        "model": kwargs.get("model"),
        "source": llm.source,
        "engine_config": dataclasses.asdict(llm.engine_config),
        "load_s": load_s,
    } | result.summary
    print(format_table(summary))
    if _SUMMARY_JSON.value:
        Path(_SUMMARY_JSON.value).write_text(
            json.dumps(summary | {"requests": result.requests, "steps": result.steps}, indent=1)
        )
    return 1 if summary["num_errors"] or summary["num_length_mismatches"] else 0


if __name__ == "__main__":
    app.run(main)
