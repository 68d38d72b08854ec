"""A model of `serve_bench.py`'s run, from measured step times: what sets its output tok/s.

It replays the benchmark's requests (the same workload, the same Poisson arrival times: seed,
rates and request count as serve_bench's) through a scheduler like the engine's: FCFS into
--num_slots slots; each step prefills the requests that arrived (one prefill call, its time by
row count) and then decodes every running request one token (its time by the decode row bucket
holding them). A request's first token comes from its prefill. Step times come from the flags,
as `engine_step_profile.py --decode_rows ...` measures them. It prints, per rate, the modeled
output tok/s and where the time went by decode bucket: with 48 requests the run lasts until its
longest request (354 tokens, the last to arrive) has decoded alone or among a few, so small
steps weigh as much as full ones.

    .venv/bin/python experiments/serve_critical_path.py \
        --decode_ms 1:15,4:17.6,8:21,16:35,32:55 --prefill_ms 1:22,2:34,4:60,8:110

A model, not a measurement: no host time, no HTTP, no chunked prompts beyond one step, and the
prefix cache is taken to hold every prompt but its last partial page (what serve_bench's later
rates see). Quote it only beside the measured runs it is checked against (RESULTS.md 51).
"""

from __future__ import annotations

import argparse
import collections
import math

import numpy as np

from jaxserve.bench.workloads import make_workload
from jaxserve.resolve import bucket_for


def table(text: str) -> dict[int, float]:
    """'1:15,8:21' -> {1: 0.015, 8: 0.021} (seconds by rows)."""
    return {int(k): float(v) / 1e3 for k, v in (kv.split(":") for kv in text.split(","))}


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    """serve_bench.run_rate's send times: an exponential gap after each request."""
    rng, t, out = np.random.default_rng(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        if math.isfinite(rate):
            t += rng.exponential(1.0 / rate)
    return out


def step_time(times: dict[int, float], rows: int) -> float:
    """The time of the smallest measured bucket holding `rows` (beyond the largest: pro rata)."""
    top = max(times)
    if rows > top:
        return times[top] * rows / top
    return times[bucket_for(rows, tuple(sorted(times)))]


def run(outs, arrive, slots, decode, prefill):
    """(seconds until the last request finishes, seconds of decode steps by bucket, of prefill)."""
    t, waiting, running = 0.0, list(range(len(outs))), {}
    by_bucket, prefill_s = collections.Counter(), 0.0
    buckets = tuple(sorted(decode))
    while waiting or running:
        new = [i for i in waiting if arrive[i] <= t][: slots - len(running)]
        if not new and not running:
            t = arrive[waiting[0]]
            continue
        if new:
            dt = step_time(prefill, len(new))
            t, prefill_s = t + dt, prefill_s + dt
            for i in new:
                waiting.remove(i)
                running[i] = outs[i] - 1  # the prefill made the first token
        if running:
            dt = step_time(decode, len(running))
            t += dt
            by_bucket[bucket_for(len(running), buckets)] += dt
            for i in list(running):
                running[i] -= 1
                if running[i] <= 0:
                    del running[i]
    return t, by_bucket, prefill_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decode_ms", required=True, help="rows:ms of a decode step, per bucket")
    ap.add_argument("--prefill_ms", required=True, help="rows:ms of a prefill step")
    ap.add_argument("--workload", default="longtail-small")
    ap.add_argument("--num_requests", type=int, default=48)
    ap.add_argument("--rates", default="4,8,12,16,inf")
    ap.add_argument("--num_slots", type=int, default=32)
    ap.add_argument("--vocab_size", type=int, default=49152)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    workload = make_workload(a.workload, a.vocab_size, a.num_requests, a.seed)
    outs = [r.max_tokens for r in workload.requests]
    decode, prefill = table(a.decode_ms), table(a.prefill_ms)
    print(f"{len(outs)} requests, {sum(outs)} output tokens, the longest {max(outs)}")
    for rate in map(float, a.rates.split(",")):
        end, by_bucket, prefill_s = run(outs, arrivals(len(outs), rate, a.seed), a.num_slots,
                                        decode, prefill)  # fmt: skip
        split = ", ".join(f"{b} rows {s:.1f} s" for b, s in sorted(by_bucket.items()))
        print(f"rate {rate:g}: {sum(outs) / end:.0f} tok/s over {end:.1f} s "
              f"(prefill {prefill_s:.1f} s; decode {split})")  # fmt: skip


if __name__ == "__main__":
    main()
