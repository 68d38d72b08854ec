"""The benchmark core: one workload through `LLM.generate`, timed after warm-up, summarized.

    run_benchmark(llm, workload) -> BenchResult(summary, requests, steps)
    CompileCounter()                 counts XLA programs compiled (or loaded) while open (0 after warm-up)
    sampling_params_for(workload)    greedy, EOS ignored, the workload's exact output lengths

`python -m jaxserve.launch.bench` is its command line (the dataflow is described there);
experiments/ call `run_benchmark` directly, several engines in one process.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import time

import numpy as np

from jaxserve.bench.workloads import Workload
from jaxserve.core.sampling_params import SamplingParams

log = logging.getLogger(__name__)

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_LOAD_EVENT = "/jax/compilation_cache/cache_retrieval_time_sec"  # a persistent-cache hit
PERCENTILES = (50, 90, 99)


class CompileCounter:
    """Counts the XLA programs built while the context is open: `count` of them and their
    `seconds`, `loaded` of those read from JAX's persistent compilation cache rather than compiled
    (0 unless the cache is set; the test suite sets one per run). jax reports a program it loads
    as a backend compile too, of the load's seconds. After warm-up, a count of 0 means nothing
    missed jit's in-memory cache."""

    def __enter__(self):
        import jax.monitoring

        self.count, self.loaded, self.seconds = 0, 0, 0.0

        def listener(event: str, duration: float, **_):
            if event == BACKEND_COMPILE_EVENT:
                self.count += 1
                self.seconds += duration
            elif event == CACHE_LOAD_EVENT:
                self.loaded += 1

        self._listener = listener
        jax.monitoring.register_event_duration_secs_listener(listener)
        return self

    def __exit__(self, *exc):
        import jax.monitoring

        jax.monitoring.unregister_event_duration_listener(self._listener)


def alternating_medians_ms(fns: dict, *args, reps: int) -> dict:
    """{name: median wall ms} of `reps` rounds that call every fn(*args) in turn, each waited for,
    after one untimed call each (the compile): the A/B timer of the kernel experiments
    (cpu_matmul.py, cpu_prefill_attention.py, since retired: JOURNAL.md 38b, 39b), so that this
    VM's drift hits every side alike.
    Each round starts one side later than the last, so that no side always runs after the same
    one (whose caches and clocks it would inherit)."""
    import jax

    for fn in fns.values():
        jax.block_until_ready(fn(*args))
    ts = {name: [] for name in fns}
    names = list(fns)
    for r in range(reps):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t = time.perf_counter()
            jax.block_until_ready(fns[name](*args))
            ts[name].append(time.perf_counter() - t)
    return {name: float(np.median(v)) * 1e3 for name, v in ts.items()}


def write_rows_json(path: str | None, rows: list[dict]) -> None:
    """An experiment's rows as {"cpu": cpu_name(), "rows": rows} at `path` (nothing if None)."""
    if path:
        with open(path, "w") as f:
            json.dump({"cpu": cpu_name(), "rows": rows}, f, indent=1)


def append_row_jsonl(path: str | None, row: dict) -> None:
    """Prints an experiment's row as one JSON line and appends it to `path` (if given), so runs
    of two checkouts, alternating, collect in one file."""
    line = json.dumps(row)
    print(line, flush=True)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def cpu_name() -> str:
    """This machine's CPU as RESULTS.md names it: /proc/cpuinfo's model name, family and model
    (the dev VMs vary between sessions: Intel with AVX-512, AMD EPYC Zen 3 or Zen 4)."""
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.processor() or platform.machine()
    avx512 = "avx512f" in info.get("flags", "").split()
    return (
        f"{info.get('model name', '?')} (family {info.get('cpu family', '?')} model "
        f"{info.get('model', '?')}{', AVX-512' if avx512 else ''}), {os.cpu_count()} cores"
    )


def prompts_for(workload: Workload) -> list[dict]:
    """The workload's prompts as `LLM.generate` takes token ids."""
    return [{"prompt_token_ids": list(r.prompt_token_ids)} for r in workload.requests]


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
    prompts = prompts_for(workload)
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
        ("engine steps", summary["num_steps"]),
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
    from jaxserve.llm import LLM

    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    return llm, time.perf_counter() - t0
