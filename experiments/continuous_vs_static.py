r"""Continuous vs static batching, side by side in one run, plus the KV-memory measurements.

    .venv/bin/python experiments/continuous_vs_static.py                   # synthetic model
    .venv/bin/python experiments/continuous_vs_static.py --model=smollm2-135m --load_format=dummy \
        --dtype=bfloat16

Model: the shared engine flags (`--model`, `--dtype`, `--page_size`, ...). With `--model` unset this
script serves a small random Llama, `SYNTHETIC` loaded with `load_format="dummy"` (vocab 8192,
hidden 256, 4 layers, 4 heads / 2 KV heads of 64, max_position_embeddings 4096; the same N(0, 0.02)
weights the earlier runs wrote to experiments/out/bench-small-llama), so the `longtail` workload
(sequences up to 1152 tokens) fits — the `tiny` preset stops at 512 positions.
Every step has one of a few fixed shapes: on the CPU a decode step computes the smallest row
bucket (`--slot_buckets`, default 8/16/32) holding the busy slots, so a nearly empty static batch
costs less than a full one; `--slot_buckets=32` gives every step the full width. What batching
changes is how many steps the workload needs, and that shows at any model size.

Measurements (all in one process, one after another, same workload, same engine flags; `--parts`
picks a subset; `--workload` / `--num_requests` are bench's flags, default `longtail`):
  1. `longtail` (256 requests, outputs geometric mean 128 capped at 1024) at --num_slots (32):
     continuous vs static output tokens/s and their ratio (target >= 3.5x), also per CPU-second of
     this process and in engine steps (both less sensitive to other load on a shared CPU); slot
     occupancy over time for both -> occupancy.png.
  2. Throughput vs slots for both modes over --slot_sweep -> throughput_vs_slots.png.
  3. KV memory: the continuous run's share of allocated page capacity holding live tokens in
     steady state (target >= 96%); then a fixed KV budget of --kv_budget_reservations x
     max_model_len tokens served with --kv_num_slots slots: the mean number of concurrent requests
     in steady state against the budget / max_model_len requests that reserving max_model_len per
     request would admit (target >= 4x).
Writes summary.json and the PNGs to --out_dir and prints a markdown table.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from pathlib import Path

import jax
from absl import app, flags

from jaxserve.bench import core as bench_core
from jaxserve.bench.workloads import make_workload
from jaxserve.config import ModelConfig
from jaxserve.launch import bench  # noqa: F401  (defines --workload, --num_requests)
from jaxserve.launch import flags as engine_flags

_OUT_DIR = flags.DEFINE_string(
    "out_dir", "experiments/out/continuous_vs_static", "Where summary.json and PNGs go."
)
_SLOT_SWEEP = flags.DEFINE_list("slot_sweep", ["4", "8", "16", "32", "64"], "Slot counts to sweep.")
_KV_BUDGET = flags.DEFINE_integer(
    "kv_budget_reservations", 4, "KV budget in units of max_model_len tokens."
)
_KV_SLOTS = flags.DEFINE_integer("kv_num_slots", 64, "Slots for the fixed-KV-budget run.")
_PARTS = flags.DEFINE_list(
    "parts", ["side_by_side", "sweep", "kv"], "Which measurements to run (see the docstring)."
)
_SWEEP_REQUESTS = flags.DEFINE_integer(
    "sweep_requests", 128, "Requests per point of the slot sweep (the first N of the workload)."
)

log = logging.getLogger("continuous_vs_static")
SYNTHETIC = ModelConfig(
    architecture="llama",
    vocab_size=8192,
    hidden_size=256,
    intermediate_size=768,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
    name="bench-small-llama",
)
MAX_MODEL_LEN = 2048


def serve(kwargs: dict, workload_for, num_requests: int | None = None, **overrides) -> dict:
    """One engine built with kwargs | overrides, warmed up, serving the workload: its summary.

    `workload_for(vocab_size)` draws the workload for the engine's model (so the model is loaded
    once per engine); `num_requests` keeps only its first requests. The 1-minute load average
    before and after is recorded: the 2 cores are shared.
    """
    load_before = os.getloadavg()[0]
    llm, load_s = bench_core.make_llm(**(kwargs | overrides))
    workload = workload_for(llm.model_config.vocab_size)
    if num_requests is not None:
        workload = dataclasses.replace(workload, requests=workload.requests[:num_requests])
    result = bench_core.run_benchmark(llm, workload)
    s = result.summary | {
        "workload": workload.name,
        "load_s": load_s,
        "num_slots": llm.engine_config.num_slots,
        "batching": llm.engine_config.batching,
        "num_pages": llm.num_pages,
        "loadavg_1m": [load_before, os.getloadavg()[0]],
    }
    log.info("%s\n%s", overrides, bench.format_table(s))
    raw = f"raw_{s['batching']}_{s['num_slots']}slots_{s['num_pages']}pages.json"
    (Path(_OUT_DIR.value) / raw).write_text(
        json.dumps({"summary": result.summary, "requests": result.requests, "steps": result.steps})
    )
    del llm
    # Drop this engine's compiled programs: a sweep builds ~50 per slot count, and after ~450 in
    # one process XLA:CPU failed to map code memory ("LLVM compilation error: Cannot allocate
    # memory", 15:55 UTC run of --slot_sweep=4,8,16,32,64).
    jax.clear_caches()
    return s | {"steps": result.steps, "max_seq_len": workload.max_seq_len}


def main(argv):
    del argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    out_dir = Path(_OUT_DIR.value)
    out_dir.mkdir(parents=True, exist_ok=True)
    kwargs = engine_flags.llm_kwargs()
    kwargs.pop("warmup", None)  # run_benchmark warms up; compiling in the constructor too is waste
    if kwargs.get("model") is None:
        kwargs.update(model=SYNTHETIC, load_format="dummy")  # random weights, no files
    kwargs.setdefault("max_model_len", MAX_MODEL_LEN)
    num_slots = kwargs.pop("num_slots", 32)

    @functools.cache
    def workload_for(vocab_size: int):
        # --workload (default longtail) and --num_requests are bench's flags.
        return make_workload(flags.FLAGS.workload, vocab_size, flags.FLAGS.num_requests)

    results: dict = {
        "engine_kwargs": kwargs,
        "workload": workload_for(8).description,  # with --num_requests, whatever the vocab
    }
    parts = set(_PARTS.value)
    if "side_by_side" in parts:
        side_by_side(results, kwargs, workload_for, num_slots, out_dir)
    if "sweep" in parts:
        slot_sweep(results, kwargs, workload_for, out_dir)
    if "kv" in parts:
        kv_budget(results, kwargs, workload_for)
    (out_dir / "summary.json").write_text(json.dumps(results, indent=1, default=str))
    print(markdown(results, num_slots))


def side_by_side(results: dict, kwargs: dict, workload_for, num_slots: int, out_dir: Path) -> None:
    """Continuous then static at the same slot count; the ratio; the occupancy plot."""
    runs = {
        m: serve(kwargs, workload_for, num_slots=num_slots, batching=m)
        for m in ("continuous", "static")
    }
    c, st = runs["continuous"], runs["static"]
    ratio = c["output_tokens_per_s"] / st["output_tokens_per_s"]
    results["side_by_side"] = {m: _strip(r) for m, r in runs.items()} | {
        "ratio": ratio,
        "ratio_per_cpu_s": c["output_tokens_per_cpu_s"] / st["output_tokens_per_cpu_s"],
        "step_ratio": st["num_steps"] / c["num_steps"],
    }
    results.setdefault("targets", {})["continuous_over_static >= 3.5"] = ratio
    results["targets"]["kv_live_token_share_steady >= 0.96 (continuous run)"] = runs["continuous"][
        "kv_live_token_share_steady"
    ]
    plot_occupancy(runs, num_slots, out_dir / "occupancy.png")


def slot_sweep(results: dict, kwargs: dict, workload_for, out_dir: Path) -> None:
    """Both modes at each slot count on the first --sweep_requests requests; the plot."""
    sweep = {m: {} for m in ("continuous", "static")}
    for n in [int(x) for x in _SLOT_SWEEP.value]:
        for m in sweep:
            sweep[m][n] = _strip(
                serve(kwargs, workload_for, _SWEEP_REQUESTS.value, num_slots=n, batching=m)
            )
    results["slot_sweep"] = {"num_requests": sweep["continuous"][n]["num_requests"]} | sweep
    plot_sweep(sweep, out_dir / "throughput_vs_slots.png")


def kv_budget(results: dict, kwargs: dict, workload_for) -> None:
    """A KV pool of --kv_budget_reservations x max_model_len tokens, --kv_num_slots slots."""
    page_size = kwargs.get("page_size", 16)
    max_len = kwargs["max_model_len"]
    budget_tokens = _KV_BUDGET.value * max_len
    kv = serve(
        kwargs,
        workload_for,
        num_slots=_KV_SLOTS.value,
        batching="continuous",
        num_pages=budget_tokens // page_size,
    )
    reserved = budget_tokens // max_len
    reserved_tight = budget_tokens // kv["max_seq_len"]
    results["kv_budget"] = {
        "budget_tokens": budget_tokens,
        "max_model_len": max_len,
        "reserved_concurrency": reserved,
        "reserved_concurrency_at_workload_max": reserved_tight,
        "workload_max_seq_len": kv["max_seq_len"],
        "mean_running_steady": kv["mean_running_steady"],
        "peak_running": kv["peak_running"],
        "concurrency_ratio": kv["mean_running_steady"] / reserved,
        "concurrency_ratio_vs_workload_max": kv["mean_running_steady"] / reserved_tight,
        "kv_live_token_share_steady": kv["kv_live_token_share_steady"],
        "run": _strip(kv),
    }
    results.setdefault("targets", {})["concurrency_vs_max_model_len_reservation >= 4"] = results[
        "kv_budget"
    ]["concurrency_ratio"]


def _strip(s: dict) -> dict:
    return {k: v for k, v in s.items() if k != "steps"}


def plot_occupancy(runs: dict, num_slots: int, path: Path) -> None:
    """Busy slots against wall time (left) and against engine step (right, load-independent)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(12, 3.8))
    for mode, r in runs.items():
        busy = [s["occupancy"] * num_slots for s in r["steps"]]
        label = f"{mode} ({r['output_tokens_per_s']:.0f} tok/s, {len(busy)} steps)"
        ax_t.plot([s["t_s"] for s in r["steps"]], busy, lw=0.8, label=label)
        ax_s.plot(range(len(busy)), busy, lw=0.8, label=mode)
    name = next(iter(runs.values()))["workload"]
    ax_t.set(
        xlabel="seconds since submission",
        ylabel=f"busy slots (of {num_slots})",
        title=f"Slot occupancy over time, {name}",
    )
    ax_s.set(
        xlabel="engine step",
        ylabel=f"busy slots (of {num_slots})",
        title=f"Slot occupancy per engine step, {name}",
    )
    ax_t.legend(loc="upper right", fontsize=8)
    ax_s.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(sweep: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, pts in sweep.items():
        xs = sorted(pts)
        ax.plot(xs, [pts[n]["output_tokens_per_s"] for n in xs], "o-", label=mode)
    xs = sorted({n for pts in sweep.values() for n in pts})
    ax.set(xscale="log", xlabel="slots", ylabel="output tokens/s", title="Throughput vs slots")
    ax.minorticks_off()
    ax.set_xticks(xs, labels=[str(n) for n in xs])
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(r: dict, num_slots: int) -> str:
    lines = []
    if "side_by_side" in r:
        sbs = r["side_by_side"]
        lines += [
            f"| {r['workload']}, {num_slots} slots | output tok/s | req/s | TTFT p50 / p99 s | "
            "TPOT p50 ms | mean occupancy | KV live share (steady) | steps |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for m in ("continuous", "static"):
            s = sbs[m]
            lines.append(
                f"| {m} | {s['output_tokens_per_s']:.1f} | {s['requests_per_s']:.2f} | "
                f"{s['ttft_s']['p50']:.2f} / {s['ttft_s']['p99']:.2f} | "
                f"{1000 * s['tpot_s']['p50']:.1f} | {s['mean_slot_occupancy']:.3f} | "
                f"{s['kv_live_token_share_steady']:.4f} | {s['num_steps']} |"
            )
        lines.append(
            f"\ncontinuous / static: {sbs['ratio']:.2f}x output tokens/s, "
            f"{sbs['ratio_per_cpu_s']:.2f}x output tokens per CPU-second, "
            f"{sbs['step_ratio']:.2f}x fewer engine steps\n"
        )
    if "slot_sweep" in r:
        cont = r["slot_sweep"]["continuous"]
        lines.append("| slots | " + " | ".join(str(n) for n in cont) + " |")
        lines.append("|---" * (1 + len(cont)) + "|")
        for m in ("continuous", "static"):
            pts = r["slot_sweep"][m]
            cells = " | ".join(f"{p['output_tokens_per_s']:.1f}" for p in pts.values())
            lines.append(f"| {m} tok/s | {cells} |")
    if "kv_budget" in r:
        kv = r["kv_budget"]
        lines.append(
            f"\nFixed KV budget {kv['budget_tokens']} tokens: mean {kv['mean_running_steady']:.1f} "
            f"concurrent in steady state (peak {kv['peak_running']}) vs "
            f"{kv['reserved_concurrency']} reserving max_model_len={kv['max_model_len']} "
            f"({kv['concurrency_ratio']:.1f}x) and {kv['reserved_concurrency_at_workload_max']} "
            f"reserving the workload's longest sequence, {kv['workload_max_seq_len']} "
            f"({kv['concurrency_ratio_vs_workload_max']:.1f}x); KV live share "
            f"{kv['kv_live_token_share_steady']:.4f}; preemptions {kv['run']['num_preemptions']}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    app.run(main)
