r"""Offline serving benchmark: one built-in workload through `LLM.generate`, timed after warm-up.

    python -m jaxserve.launch.bench --model=tiny --load_format=dummy --workload=longtail \
        --batching=continuous --num_slots=32 --summary_json=/tmp/bench.json

Dataflow:
  1. `make_workload(--workload, vocab_size, --num_requests, --seed)`: token-id prompts with exact
     output lengths (greedy, `ignore_eos=True`, `max_tokens` = the drawn length).
  2. Build the `LLM` from the shared engine flags (`jaxserve.launch.flags`) plus `--batching`;
     `--num_slots` overrides the workload's default slot count only when given. Load time is measured.
  3. Warm-up: one request per power-of-two page-table width up to the workload's longest sequence
     (prompt of that many tokens minus two, three output tokens), then one batch filling every slot,
     so every prefill/decode shape the timed run can meet compiles here. JAX's backend-compile
     events are counted separately for warm-up and for the timed run (the latter should be 0).
  4. Timed run: `llm.generate(all prompts)`; wall time from submission to the last output.
  5. Summary: output tokens/s (and per CPU-second of this process, a figure less sensitive to
     other processes on a shared CPU) and the host loop's share of that CPU time (the calling
     thread: scheduling, dispatch, detokenizing; the rest is XLA's threads), requests/s, TTFT and TPOT p50/p90/p99 (from each output's
     `RequestMetrics`), mean slot occupancy and KV-page utilization (from `llm.stats()`), and the
     request timeline (first-token and finish times relative to submission) for occupancy plots.

`run_benchmark(llm, workload, ...)` is the reusable core (experiments/ call it in one process).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

import numpy as np
from absl import app, flags

from jaxserve.bench.workloads import SPECS, Workload, make_workload
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.launch import flags as engine_flags

log = logging.getLogger(__name__)

_BATCHING = flags.DEFINE_enum(
    "batching",
    "continuous",
    ["continuous", "static"],
    "continuous: refill a slot as soon as its request finishes; static: refill only when the "
    "whole batch has finished (the baseline).",
)
_WORKLOAD = flags.DEFINE_enum("workload", "longtail", sorted(SPECS), "Built-in workload to serve.")
_NUM_REQUESTS = flags.DEFINE_integer(
    "num_requests", None, "Override the workload's number of requests."
)
_SUMMARY_JSON = flags.DEFINE_string("summary_json", None, "Write the JSON summary to this path.")
_WARMUP = flags.DEFINE_bool("warmup", True, "Compile every shape before the timed run.")

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
PERCENTILES = (50, 90, 99)


class CompileCounter:
    """Counts XLA backend compilations (and their seconds) while the context is open."""

    def __enter__(self):
        import jax.monitoring

        self.count, self.seconds = 0, 0.0

        def listener(event: str, duration: float, **_):
            if event == BACKEND_COMPILE_EVENT:
                self.count += 1
                self.seconds += duration

        self._listener = listener
        jax.monitoring.register_event_duration_secs_listener(listener)
        return self

    def __exit__(self, *exc):
        import jax.monitoring

        jax.monitoring.unregister_event_duration_listener(self._listener)


def sampling_params_for(workload: Workload) -> list[SamplingParams]:
    """Greedy, EOS ignored, exact length: the output length is the workload's, not the model's."""
    return [
        SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
        for r in workload.requests
    ]


def warmup(llm, num_slots: int, vocab_size: int) -> dict:
    """`llm.warmup()` (every step variant, every page-table width) and one short full batch."""
    t0 = time.perf_counter()
    with CompileCounter() as cc:
        engine_s = llm.warmup()
        tok = min(32, vocab_size // 4)
        outs = llm.generate(
            [{"prompt_token_ids": [tok] * 8}] * num_slots,
            SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
            use_tqdm=False,
        )
        errors = [o.error for o in outs if o.error]
        if errors:
            raise RuntimeError(f"warm-up request failed: {errors[0]}")
    return {
        "warmup_s": time.perf_counter() - t0,
        "engine_warmup_s": engine_s,
        "warmup_compiles": cc.count,
        "warmup_compile_s": cc.seconds,
    }


def percentiles(values: list[float]) -> dict:
    if not values:
        return {f"p{p}": None for p in PERCENTILES} | {"mean": None}
    a = np.asarray(values, dtype=np.float64)
    return {f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES} | {"mean": float(a.mean())}


@dataclasses.dataclass
class BenchResult:
    summary: dict  # the JSON summary (no per-step data)
    requests: list[dict]  # per request: prompt_len, output_len, first_token_s, finished_s
    steps: list[dict]  # per engine step: t_s, occupancy, kv_live_share (None: no pages in use)


def run_benchmark(llm, workload: Workload, *, do_warmup: bool = True) -> BenchResult:
    """Warms up `llm`, serves every request of `workload` in one `generate`, summarizes.

    Times are seconds since submission (`time.monotonic()`, the clock of `RequestMetrics`);
    step times come from the engine's timeline, re-based on the first timed step.
    """
    config = llm.engine_config
    summary: dict = {}
    if do_warmup:
        summary |= warmup(llm, config.num_slots, workload.vocab_size)
    before = llm.stats()
    sched = llm.engine.scheduler
    rows_before, plans_before = sched.decode_rows_sum, sched.num_decode_plans
    n_timeline = len(llm.engine.timeline)
    prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in workload.requests]
    params = sampling_params_for(workload)
    with CompileCounter() as cc:
        t0, cpu0, host0 = time.monotonic(), time.process_time(), time.thread_time()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.monotonic() - t0
        cpu_s = time.process_time() - cpu0  # all threads of this process (XLA's included)
        host_cpu_s = time.thread_time() - host0  # this thread: host loop, dispatch, detokenizer
    after = llm.stats()

    errors = [o.error for o in outputs if o.error]
    ok = [(o, r) for o, r in zip(outputs, workload.requests) if not o.error]
    requests = [
        {
            "prompt_len": len(r.prompt_token_ids),
            "output_len": len(o.outputs[0].token_ids),
            "first_token_s": o.metrics.first_token_time - t0,
            "finished_s": o.metrics.finished_time - t0,
        }
        for o, r in ok
    ]
    timed = list(llm.engine.timeline)[n_timeline:]
    if len(timed) != after["num_steps"] - before["num_steps"]:
        raise RuntimeError("the engine timeline dropped steps; the run is longer than it keeps")
    t_first = timed[0][0] if timed else 0.0
    steps = [{"t_s": t - t_first, "occupancy": occ, "kv_live_share": u} for t, occ, u in timed]
    n_tokens = sum(q["output_len"] for q in requests)
    summary |= {
        "timed_compiles": cc.count,
        "timed_compile_s": cc.seconds,
        "elapsed_s": elapsed,
        "num_requests": len(outputs),
        "num_errors": len(errors),
        "num_length_mismatches": sum(len(o.outputs[0].token_ids) != r.max_tokens for o, r in ok),
        "output_tokens": n_tokens,
        "prompt_tokens": workload.total_prompt_tokens,
        "output_tokens_per_s": n_tokens / elapsed,
        "cpu_s": cpu_s,
        "output_tokens_per_cpu_s": n_tokens / cpu_s if cpu_s > 0 else None,
        "host_cpu_s": host_cpu_s,
        "host_cpu_share": host_cpu_s / cpu_s if cpu_s > 0 else None,
        "requests_per_s": len(outputs) / elapsed,
        "ttft_s": percentiles([o.metrics.ttft for o, _ in ok if o.metrics.ttft is not None]),
        "tpot_s": percentiles([o.metrics.tpot for o, _ in ok if o.metrics.tpot is not None]),
        "num_steps": after["num_steps"] - before["num_steps"],
        "num_preemptions": after["num_preemptions"] - before["num_preemptions"],
        "num_h2d_transfers": after["num_h2d_transfers"] - before["num_h2d_transfers"],
        "num_d2h_transfers": after["num_d2h_transfers"] - before["num_d2h_transfers"],
        "num_kv_pages": after["num_kv_pages"],
        "num_slot_moves": after["num_slot_moves"] - before["num_slot_moves"],
        "num_fused_steps": after["num_fused_steps"] - before["num_fused_steps"],
        "mean_decode_rows": (sched.decode_rows_sum - rows_before)
        / max(sched.num_decode_plans - plans_before, 1),
    } | step_summary(
        steps, config.num_slots, max((q["first_token_s"] for q in requests), default=0.0)
    )
    if errors:
        log.error("%d requests failed; first: %s", len(errors), errors[0])
    return BenchResult(summary=summary, requests=requests, steps=steps)


def step_summary(steps: list[dict], num_slots: int, saturated_until_s: float) -> dict:
    """Slot occupancy and KV use over the timed steps.

    mean_slot_occupancy: running requests / num_slots, averaged per step.
    kv_page_utilization: live K/V tokens / (allocated pages * page_size), averaged over steps
      with pages in use (the engine's own measure).
    The steady state is the saturated phase: steps up to `saturated_until_s`, the first-token time
    of the last request to start, so requests were still waiting and the engine ran as many as its
    slots and KV pages allowed (the drain after it, with ever fewer requests, is excluded).
    kv_live_token_share_steady / mean_running_steady: KV utilization and running requests
      averaged over the steady state.
    """
    if not steps:
        return {}
    occ = np.array([s["occupancy"] for s in steps])
    util = np.array([np.nan if s["kv_live_share"] is None else s["kv_live_share"] for s in steps])
    t = np.array([s["t_s"] for s in steps])
    steady = t <= saturated_until_s
    if not steady.any():
        steady[:] = True
    return {
        "mean_slot_occupancy": float(occ.mean()),
        "kv_page_utilization": float(np.nanmean(util)),
        "kv_live_token_share_steady": float(np.nanmean(util[steady])),
        "mean_running_steady": float(occ[steady].mean() * num_slots),
        "peak_running": int(round(occ.max() * num_slots)),
        "steady_steps": int(steady.sum()),
    }


def format_table(summary: dict) -> str:
    rows = [
        ("workload", summary.get("workload")),
        ("batching", summary.get("batching")),
        ("num_slots", summary.get("num_slots")),
        ("requests (errors)", f"{summary['num_requests']} ({summary['num_errors']})"),
        ("output tokens", summary["output_tokens"]),
        ("load s", summary.get("load_s")),
        (
            "warm-up s (compiles)",
            _with_count(summary.get("warmup_s"), summary.get("warmup_compiles")),
        ),
        ("timed run s (compiles)", _with_count(summary["elapsed_s"], summary["timed_compiles"])),
        (
            "engine steps (fused decode + prefill)",
            f"{summary['num_steps']} ({summary.get('num_fused_steps', 0)})",
        ),
        ("output tokens/s", summary["output_tokens_per_s"]),
        ("output tokens/CPU-s", summary["output_tokens_per_cpu_s"]),
        ("host-loop share of CPU-s", summary.get("host_cpu_share")),
        ("requests/s", summary["requests_per_s"]),
        ("TTFT p50/p90/p99 ms", _pcts_ms(summary["ttft_s"])),
        ("TPOT p50/p90/p99 ms", _pcts_ms(summary["tpot_s"])),
        ("mean slot occupancy", summary.get("mean_slot_occupancy")),
        ("KV page utilization", summary.get("kv_page_utilization")),
        ("KV live share (steady)", summary.get("kv_live_token_share_steady")),
        (
            "mean decode rows (slot moves)",
            _with_count(summary.get("mean_decode_rows"), summary.get("num_slot_moves")),
        ),
        ("preemptions", summary["num_preemptions"]),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {_fmt(v)}" for k, v in rows)


def _with_count(seconds, count) -> str:
    return "n/a" if seconds is None else f"{seconds:.2f} ({count})"


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4f}" if abs(v) < 1 else f"{v:,.1f}"
    return str(v)


def _pcts_ms(p: dict) -> str:
    if p["p50"] is None:
        return "n/a"
    return " / ".join(f"{1000 * p[f'p{q}']:.1f}" for q in PERCENTILES)


def make_llm(**kwargs):
    """Builds the engine (a seam for tests); returns (llm, load seconds)."""
    from jaxserve import LLM

    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    return llm, time.perf_counter() - t0


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    kwargs = engine_flags.llm_kwargs()
    spec = SPECS[_WORKLOAD.value]
    kwargs.setdefault("num_slots", spec.num_slots)  # --num_slots overrides the workload's
    llm, load_s = make_llm(**kwargs, batching=_BATCHING.value)
    workload = make_workload(
        _WORKLOAD.value,
        llm.model_config.vocab_size,
        _NUM_REQUESTS.value,
        seed=kwargs.get("seed", 0),
    )
    if workload.max_seq_len > llm.engine_config.max_model_len:
        raise app.UsageError(
            f"--max_model_len={llm.engine_config.max_model_len} is below the workload's longest "
            f"sequence ({workload.max_seq_len} tokens)"
        )
    result = run_benchmark(llm, workload, do_warmup=_WARMUP.value)
    summary = {
        "workload": workload.name,
        "workload_description": workload.description,
        "batching": _BATCHING.value,
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
