"""The prepared GPU run's timings -> a proposed GPU kernel table, and its RESULTS table.

    python -m jaxserve.bench.kernel_choices OUT_DIR [--out jaxserve/config/gpu_kernel_choices.toml]
        [--table PATH] [--chip CHIP] [--commit C] [--base FILE]

OUT_DIR holds what `experiments/gpu_kernels.py` and/or `experiments/gpu_quant_matmul.py` wrote
(their JSON, found at any depth: `gpu_checks.sh` puts them in kernels/ and w8/). The output (to
--out, else stdout) is the whole table (`--base`, default the shipped one) with the run's chip's
rows replaced:

1. Every timed shape becomes a `Sample`: each candidate's us per call, whether its output matched
   the reference there, and the bytes (or flops) a call moves. The engine's candidates are the
   table's (`config.gpu_choices.CANDIDATES`: the Triton kernel 'pallas', the Mosaic GPU 'mgpu',
   XLA's 'reference' attention or 'xla' unpack / convert + dot); cuDNN, the bf16 dot and XLA's
   native INT4 are timed beside them for the RESULTS table but cannot be chosen.
2. Per op and shape bucket (the base table's buckets of rows for the matmuls; one bucket for
   attention): each candidate's time over the fastest's on every shape all of them ran, as a
   geometric mean. A candidate wrong on one shape is out of that bucket.
3. The engine runs only some tables (`gpu_choices`: one attention impl for decode and prefill; one
   kernel on every quantized weight's smallest buckets, XLA's path above them), so the proposal
   is the runnable table of least summed ratio over the measured buckets (ties: the base's).
   Measured rows get `measured = true` and a source naming the device, date and commit; a smoke run
   (interpret mode on a CPU) keeps `measured = false`. Rows the run did not time stay as they were.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

from jaxserve.config import gpu_choices as gc

# candidate -> the JSON's field prefix (its us, ok: "<prefix>_us", "<prefix>_ok")
ATTENTION_FIELDS = {"pallas": "kernel", "mgpu": "mgpu", "reference": "xla_ref", "cudnn": "cudnn"}
MATMUL_FIELDS = {
    "pallas": "triton",
    "mgpu": "mosaic",
    "xla": "xla",
    "bf16": "bf16",
    "xla_int4": "xla_int4",
    "xla_int4_noflag": "xla_int4_noflag",
}


@dataclasses.dataclass(frozen=True)
class Sample:
    """One timed shape of one op: per candidate, its us per call and whether its output was right."""

    op: str  # a table op (`gpu_choices.CANDIDATES`)
    shape: str  # e.g. "B64 ctx4096 ps16 bf16 KV", "int4 M8 4096x14336"
    rows: int | None  # a matmul's rows M (its bucket); None for attention
    us: dict[str, float]
    ok: dict[str, bool]
    nbytes: dict[str, float]  # bytes a call reads, where a rate in GB/s means something
    flops: float | None = None  # a prefill call's flops (a rate in TFLOP/s)


def attention_samples(res: dict) -> list[Sample]:
    """experiments/gpu_kernels.py's decode and prefill rows (the timed ones)."""
    out = []
    for kind in ("decode", "prefill"):
        for r in res.get(kind, []):
            if "kernel_us" not in r:
                continue
            shape = f"B{r['batch']} ctx{r['context']} ps{r['page_size']} {r['kv']} KV"
            if kind == "prefill":
                shape = f"B{r['batch']} T{r['chunk']} ctx{r['context']} {r['kv']} KV"
            us = {c: r[f"{f}_us"] for c, f in ATTENTION_FIELDS.items() if f"{f}_us" in r}
            ok = {c: r.get(f"{f}_ok", True) for c, f in ATTENTION_FIELDS.items() if c in us}
            nbytes, flops = {}, None
            if "kernel_gbs" in r:  # the KV bytes a step reads, whoever reads them
                nbytes = dict.fromkeys(us, r["kernel_gbs"] * r["kernel_us"] * 1e3)
            if "kernel_tflops" in r:
                flops = r["kernel_tflops"] * r["kernel_us"] * 1e6
            out.append(Sample(f"{kind}_attention", shape, None, us, ok, nbytes, flops))
    return out


def matmul_samples(res: dict) -> list[Sample]:
    """experiments/gpu_quant_matmul.py's rows (the timed ones)."""
    out = []
    for r in res.get("rows", []):
        if "bf16_us" not in r:  # not timed (skipped by the budget); a failed candidate has no _us
            continue
        us = {c: r[f"{f}_us"] for c, f in MATMUL_FIELDS.items() if f"{f}_us" in r}
        ok = {c: r.get(f"{f}_ok", r["ok"]) for c, f in MATMUL_FIELDS.items() if c in us}
        ok.update(bf16=True, xla_int4_noflag=ok.get("xla_int4", True))
        quantized = r["weight_bytes"]
        nbytes = {c: quantized for c in ("pallas", "mgpu", "xla")} | {"bf16": 2 * r["k"] * r["n"]}
        if "xla_int4_gbs" in r:
            nbytes |= dict.fromkeys(
                ("xla_int4", "xla_int4_noflag"), r["xla_int4_gbs"] * 1e3 * r["xla_int4_us"]
            )
        op = "int4_matmul" if r["kind"] == "int4" else "w8_matmul"
        shape = f"{r['kind']} M{r['m']} {r['k']}x{r['n']}"
        out.append(Sample(op, shape, r["m"], us, ok, nbytes))
    return out


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The engine candidates of one op over one bucket's samples."""

    shapes: int  # samples on which every candidate below ran (0: not measured)
    ratio: dict[str, float]  # candidate -> geomean of its time over the fastest's
    wrong: frozenset[str]  # candidates whose output was wrong on some sample

    def cost(self, candidate: str) -> float:
        """What choosing `candidate` here costs: its ratio (0 when unmeasured; inf when wrong or
        not timed)."""
        if not self.shapes:
            return 0.0
        if candidate in self.wrong or candidate not in self.ratio:
            return math.inf
        return self.ratio[candidate]

    def describe(self) -> str:
        ranked = sorted(self.ratio.items(), key=lambda kv: kv[1])
        parts = [f"{c} {r:.2f}" + (" (wrong output)" if c in self.wrong else "") for c, r in ranked]
        shapes = f"{self.shapes} shape{'s' if self.shapes > 1 else ''}"
        return f"time over the fastest's on {shapes} (geomean): " + ", ".join(parts)


def verdict(samples: list[Sample], op: str) -> Verdict:
    """Step 2 of the module doc over `samples` (one op, one bucket)."""
    candidates = [c for c in gc.CANDIDATES[op] if samples and all(c in s.us for s in samples)]
    if not candidates:
        return Verdict(0, {}, frozenset())
    logs = {c: 0.0 for c in candidates}
    for s in samples:
        best = min(s.us[c] for c in candidates)
        for c in candidates:
            logs[c] += math.log(s.us[c] / best)
    ratio = {c: math.exp(v / len(samples)) for c, v in logs.items()}
    wrong = frozenset(c for c in candidates if not all(s.ok[c] for s in samples))
    return Verdict(len(samples), ratio, wrong)


def propose(
    base: tuple[gc.Choice, ...], samples: list[Sample], chip: str, run: str, measured: bool
) -> tuple[gc.Choice, ...]:
    """The base table with `chip`'s rows replaced by step 3's proposal (a new chip starts from
    the default's rows)."""
    rows = [c for c in base if c.chip == chip]
    if not rows:
        rows = [
            dataclasses.replace(c, chip=chip, source=f"no {chip} rows before {run}: {c.source}")
            for c in base
            if c.chip == gc.DEFAULT_CHIP
        ]
    verdicts = {}
    for c in rows:
        held = [s for s in samples if s.op == c.op and (s.rows is None or c.holds(s.rows))]
        verdicts[c] = verdict(held, c.op)
    new = {}
    att = [c for c in rows if c.op in gc.ATTENTION_OPS]
    new |= _least(att, verdicts, [dict.fromkeys(att, k) for k in gc.CANDIDATES[att[0].op]])
    mm = [c for c in rows if c.op in gc.MATMUL_OPS]
    new |= _least(mm, verdicts, _matmul_plans(mm))
    out = []
    for c in rows:
        v, pick = verdicts[c], new[c]
        if not v.shapes and pick == c.candidate:
            out.append(c)  # not timed in this run, unchanged
            continue
        if not v.shapes:
            source = f"not timed in {run}: follows the measured rows (what the engine can run)"
        else:
            source = f"{run}: {v.describe()}"
            fastest = min((k for k in v.ratio if k not in v.wrong), key=v.ratio.get, default=None)
            if fastest not in (None, pick):
                source += f"; {fastest} is fastest here, but the engine runs {pick} with the rest"
        out.append(
            dataclasses.replace(
                c, candidate=pick, measured=measured and v.shapes > 0, source=source
            )
        )
    # the chip's rows where they were (a new chip's at the end)
    before = list(itertools.takewhile(lambda c: c.chip != chip, base))
    after = [c for c in base[len(before) :] if c.chip != chip]
    return tuple(before + out + after)


def _matmul_plans(rows: list[gc.Choice]) -> list[dict]:
    """Every assignment of candidates to the matmul rows that the engine can run: one kernel, and
    per op a row limit at a bucket's end (0: no kernel)."""
    plans = []
    ops = [[c for c in rows if c.op == op] for op in gc.MATMUL_OPS]
    limits = [[0, *(c.max_rows for c in op_rows if c.max_rows is not None)] for op_rows in ops]
    for kernel in gc.KERNELS:
        for chosen in itertools.product(*limits):
            plans.append(
                {
                    c: kernel if c.max_rows is not None and c.max_rows <= limit else "xla"
                    for op_rows, limit in zip(ops, chosen)
                    for c in op_rows
                }
            )
    return plans


def _least(rows: list[gc.Choice], verdicts: dict, plans: list[dict]) -> dict:
    """The plan of least summed cost over `rows` (ties: the fewest changes from the base);
    the base itself when no plan has a finite cost."""

    def key(plan):
        cost = sum(verdicts[c].cost(plan[c]) for c in rows)
        return cost, sum(plan[c] != c.candidate for c in rows)

    best = min(plans, key=key)
    return best if math.isfinite(key(best)[0]) else {c: c.candidate for c in rows}


def table(samples: list[Sample], copy_gbs: float | None) -> str:
    """The RESULTS table: one line per shape and candidate, fastest first."""
    lines = [
        "| op | shape | candidate | us | GB/s | % of copy bandwidth | TFLOP/s | x fastest | correct |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for s in samples:
        best = min(s.us.values())
        for c, us in sorted(s.us.items(), key=lambda kv: kv[1]):
            gbs = s.nbytes[c] / us / 1e3 if c in s.nbytes else None
            pct = f"{100 * gbs / copy_gbs:.1f}" if gbs and copy_gbs else ""
            tflops = f"{s.flops / us / 1e6:.1f}" if s.flops else ""
            lines.append(
                f"| {s.op} | {s.shape} | {c} | {us:.1f} | {f'{gbs:.0f}' if gbs else ''} | {pct} "
                f"| {tflops} | {us / best:.2f} | {'yes' if s.ok[c] else 'NO'} |"
            )
    return "\n".join(lines) + "\n"


def read_run(out_dir: Path) -> tuple[dict, dict]:
    """(gpu_kernels.json, gpu_quant_matmul.json) under out_dir, each {} when absent."""
    found = []
    for name in ("gpu_kernels.json", "gpu_quant_matmul.json"):
        paths = sorted(out_dir.rglob(name))
        if len(paths) > 1:
            raise ValueError(f"{out_dir} holds {len(paths)} {name}: name one run's directory")
        found.append(json.loads(paths[0].read_text()) if paths else {})
    if not any(found):
        raise ValueError(f"no gpu_kernels.json or gpu_quant_matmul.json under {out_dir}")
    devices = {r["device"] for r in found if r}
    if len(devices) > 1:
        raise ValueError(f"the JSON files under {out_dir} come from different devices: {devices}")
    return found[0], found[1]


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
    except OSError:
        return "unknown"
    return out.stdout.strip() or "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path, help="the GPU run's output directory")
    ap.add_argument("--base", help="the table to update (default: the shipped one)")
    ap.add_argument("--chip", help="the table's chip (default: from the JSON's device kind)")
    ap.add_argument("--commit", help="the commit the run ran (default: git's HEAD here)")
    ap.add_argument("--out", type=Path, help="write the table here (default: stdout)")
    ap.add_argument("--table", type=Path, help="also write the RESULTS table (markdown) here")
    opts = ap.parse_args(argv)
    kernels, quant = read_run(opts.out_dir)
    first = kernels or quant
    base = gc.load(opts.base)
    chip = opts.chip or gc.chip_of(first["device"], base)
    smoke = any(r.get("smoke") for r in (kernels, quant) if r)
    dates = sorted({r.get("date", "date unknown") for r in (kernels, quant) if r})
    run = f"{first['device']} ({chip}) run of {', '.join(dates)} at {opts.commit or git_commit()}"
    if smoke:
        run += " (smoke: interpret mode on a CPU, not timings)"
    samples = attention_samples(kernels) + matmul_samples(quant)
    choices = propose(base, samples, chip, run, measured=not smoke)
    text = gc.to_toml(choices)
    gc.parse(text, "the proposed table")  # what the engine can run, by construction
    if opts.out:  # after the base is read: --out may be the shipped table itself
        opts.out.write_text(text)
    else:
        sys.stdout.write(text)
    if opts.table:
        opts.table.write_text(table(samples, kernels.get("copy_gbs")))
    changed = [c for c in choices if c not in base]
    print(f"{chip}: {len(changed)} rows changed ({run})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
