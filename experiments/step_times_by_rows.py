"""Where a `jaxserve.launch.bench` run's time went, by how many slots each engine step had busy.

Reads the run's --summary_json (its per-step timeline: start time and slot occupancy) and prints,
per band of busy rows, the steps, their median duration and their total; then the workload's
longest requests (a run cannot take fewer steps than its longest output).

    .venv/bin/python -m jaxserve.launch.bench --dtype=bfloat16 --workload=longtail-small \\
        --num_requests=48 --num_slots=32 --summary_json=experiments/out/bench48.json
    .venv/bin/python experiments/step_times_by_rows.py experiments/out/bench48.json
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from jaxserve.bench.workloads import make_workload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("summary_json")
    ap.add_argument("--bands", default="8,16,32", help="upper bounds of the busy-row bands")
    ap.add_argument("--vocab_size", type=int, default=49152, help="the workload's (SmolLM2's)")
    a = ap.parse_args()
    d = json.load(open(a.summary_json))
    steps = d["steps"]
    t = np.array([s["t_s"] for s in steps])
    rows = np.array([s["occupancy"] for s in steps])[:-1] * d["num_slots"]
    dt = np.diff(t)  # step i lasts from its start to the next one's
    lo = 0
    for hi in map(int, a.bands.split(",")):
        m = (rows > lo) & (rows <= hi)
        med = 1000 * np.median(dt[m]) if m.any() else float("nan")
        print(
            f"busy rows {lo + 1}-{hi}: {int(m.sum())} steps, median {med:.1f} ms, "
            f"total {dt[m].sum():.1f} s"
        )
        lo = hi
    print(f"all: {len(dt)} steps, {dt.sum():.1f} s")
    w = make_workload(d["workload"], vocab_size=a.vocab_size, num_requests=d["num_requests"])
    lens = sorted((r.max_tokens for r in w.requests), reverse=True)
    print(f"longest outputs: {lens[:6]}, total {sum(lens)} tokens")


if __name__ == "__main__":
    main()
