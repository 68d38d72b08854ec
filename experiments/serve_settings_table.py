"""The table of a run_serve_settings.sh folder: for every setting (a run folder's name up to its
last '_', the round after it) and request rate, jaxserve's output tok/s, TPOT p50 and TTFT p99 in
each round, then the medians over the rounds.

    python3 experiments/serve_settings_table.py experiments/out/RUN
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def load(folder: Path) -> dict[str, list[list[dict]]]:
    """setting -> one list of per-rate results per round, in round order."""
    runs: dict[str, list[tuple[int, list[dict]]]] = defaultdict(list)
    for f in folder.glob("*_*/serve_jaxserve.json"):
        name, _, round_ = f.parent.name.rpartition("_")
        if not round_.isdigit():
            continue
        runs[name].append((int(round_), json.loads(f.read_text())["results"]))
    return {name: [rs for _, rs in sorted(v)] for name, v in sorted(runs.items())}


def main() -> None:
    folder = Path(sys.argv[1])
    runs = load(folder)
    if not runs:
        sys.exit(f"no NAME_ROUND/serve_jaxserve.json under {folder}")
    print(
        "| setting | rate | output tok/s per round | median | TPOT p50 s (median) | TTFT p99 s (median) | failed |"
    )
    print("|---|---|---|---:|---:|---:|---:|")
    for name, rounds in runs.items():
        for i, first in enumerate(rounds[0]):
            rows = [rs[i] for rs in rounds]
            toks = [r["output_tok_s"] for r in rows]
            print(
                f"| {name} | {first['request_rate']} | {' / '.join(f'{t:.1f}' for t in toks)} | "
                f"{statistics.median(toks):.1f} | "
                f"{statistics.median(r['tpot_p50_s'] for r in rows):.4f} | "
                f"{statistics.median(r['ttft_p99_s'] for r in rows):.2f} | "
                f"{sum(r['failed'] for r in rows)} |"
            )


if __name__ == "__main__":
    main()
