"""Per-job statistics and the summary JSON written beside the output file.

`JobStats.add(row, output)` is called once per finished row; `summary(...)` turns the totals, the
latency samples (TTFT, TPOT) and the engine's own counters (`llm.stats()`) into one JSON object,
written atomically (temp file + rename) to `<output without .jsonl>.summary.json`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import Any

PERCENTILES = (50, 90, 99)


def summary_path(output_path: str) -> str:
    """`out/shard-3.jsonl` -> `out/shard-3.summary.json`."""
    base = output_path[: -len(".jsonl")] if output_path.endswith(".jsonl") else output_path
    return base + ".summary.json"


def percentiles(values: list[float]) -> dict[str, float] | None:
    """{'p50', 'p90', 'p99', 'mean', 'max'} by nearest rank, or None for no samples."""
    if not values:
        return None
    xs = sorted(values)
    pick = lambda q: xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]
    out = {f"p{q}": pick(q) for q in PERCENTILES}
    out["mean"] = sum(xs) / len(xs)
    out["max"] = xs[-1]
    return out


@dataclasses.dataclass
class JobStats:
    """What this run did (rows skipped because an earlier run finished them are not counted)."""

    start_time: float = dataclasses.field(default_factory=time.monotonic)
    num_ok: int = 0
    num_failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    preemptions: int = 0
    ttft: list[float] = dataclasses.field(default_factory=list)
    tpot: list[float] = dataclasses.field(default_factory=list)

    def add_error(self) -> None:
        self.num_failed += 1

    def add_output(self, prompt_tokens: int, completion_tokens: int, metrics: Any) -> None:
        """Counts one successfully finished row; `metrics` is its `RequestMetrics` (or None)."""
        self.num_ok += 1
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        if metrics is None:
            return
        if getattr(metrics, "ttft", None) is not None:
            self.ttft.append(float(metrics.ttft))
        if getattr(metrics, "tpot", None) is not None and completion_tokens > 1:
            self.tpot.append(float(metrics.tpot))
        self.preemptions += int(getattr(metrics, "num_preemptions", 0) or 0)

    @property
    def elapsed(self) -> float:
        return max(time.monotonic() - self.start_time, 1e-9)

    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.elapsed


def summary(
    stats: JobStats,
    *,
    rows_in_shard: int,
    rows_done_before: int,
    ok_before: int,
    failed_before: int,
    interrupted: str | None,
    engine_stats: dict[str, Any] | None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The summary JSON object. Row totals cover the whole output file (this run plus earlier ones);
    throughput and latencies cover this run."""
    wall = stats.elapsed
    this_run = stats.num_ok + stats.num_failed
    done = rows_done_before + this_run
    return {
        **(extra or {}),
        "complete": done >= rows_in_shard and interrupted is None,
        "interrupted": interrupted,
        "rows": {
            "in_shard": rows_in_shard,
            "ok": ok_before + stats.num_ok,
            "failed": failed_before + stats.num_failed,
            "remaining": max(rows_in_shard - done, 0),
            "skipped_already_done": rows_done_before,
            "this_run": {"ok": stats.num_ok, "failed": stats.num_failed},
        },
        "this_run": {
            "wall_s": wall,
            "rows_per_s": this_run / wall,
            "prompt_tokens": stats.prompt_tokens,
            "completion_tokens": stats.completion_tokens,
            "completion_tokens_per_s": stats.completion_tokens / wall,
            "total_tokens_per_s": (stats.prompt_tokens + stats.completion_tokens) / wall,
            "ttft_s": percentiles(stats.ttft),
            "tpot_s": percentiles(stats.tpot),
            "preemptions": stats.preemptions,
        },
        "engine": engine_stats,
    }


def write_summary(path: str, obj: dict[str, Any]) -> None:
    """Writes `obj` as JSON to `path` atomically (a reader never sees half a file)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, default=_jsonable)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _jsonable(x: Any) -> Any:
    """json.dump fallback for engine counters: numpy scalars/arrays, dataclasses, anything else."""
    if hasattr(x, "tolist"):
        return x.tolist()
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.asdict(x)
    return str(x)
