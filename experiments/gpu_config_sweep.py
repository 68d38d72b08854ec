"""Every kernel configuration a GPU engine can pick, its whole warm-up set compiled deviceless for
an H100 and an H200 (issue 55).

    python experiments/gpu_config_sweep.py [--targets h100,h200] [--kinds decode,prefill]
                                           [--kernels mosaic,triton] [--out DIR] [--budget_s S]
    python experiments/gpu_config_sweep.py --smoke        # one configuration, one target

Configurations: kernels in {mosaic ('mgpu' attention_impl and quant_matmul_impl), triton
('pallas' both: what 'auto' picks on a GPU)} x weights in {bf16, int4-rtn, int8, fp8} x KV cache
in {bf16, int8, fp8}, on a small Llama whose shapes every Mosaic kernel takes (2 layers, hidden
256, 4 heads of 64, 2 KV heads, MLP 512: so the Mosaic kernels are what compiles, not their
Triton twins), 8 slots, 64 positions, 32-token prefill chunks, bf16 activations. Each
configuration's programs are `gpu_programs.warmup_programs` of the kinds asked (default: the
decode and prefill forwards, which hold the kernels; the samplers and slot updates hold none and
compile in tests/bench/test_gpu_programs.py), each compiled for the target with the engine's XLA
options and read back (`gpu_report`). Compiling is slow (~7 s a program with Mosaic kernels on
the 2-core CPU), so a budget skips what it cannot reach, marked as skipped.

Per configuration and target it records: programs compiled, those that did not compile (name and
error), Mosaic GPU calls and Pallas Triton kernels in the set, weight bytes copied (INT4 prefill
chunks above the kernels' 16 rows take XLA's unpack + dot, which writes each layer's bf16 weight:
the open item of JOURNAL.md 54d), and host round trips outside the prompt-logprob programs (one
per scoring row by design, tests/bench/test_gpu_programs.py). A configuration passes when every
program compiles, a mosaic configuration holds no Pallas Triton kernel and a triton one no Mosaic
call, and no program but a prompt-logprob one waits on the host. Results: DIR/gpu_config_sweep.json (rewritten
after each configuration) and .md; DIR defaults to experiments/out/gpu_config_sweep. Exit status
1 when a configuration fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import time
from pathlib import Path

from jaxserve.bench import deviceless

deviceless.prepare()  # before jax starts its backends

from jaxserve.bench import gpu_programs  # noqa: E402
from jaxserve.config import EngineConfig, ModelConfig  # noqa: E402

MODEL = dataclasses.replace(
    ModelConfig.preset("tiny"),
    hidden_size=256,
    intermediate_size=512,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    vocab_size=512,
    name="sweep-d64",
)
KERNELS = {"mosaic": "mgpu", "triton": "pallas"}
WEIGHTS = (None, "int4-rtn", "int8", "fp8")
KV = ("auto", "int8", "fp8")
TRITON_PREFIXES = ("paged_decode", "paged_prefill", "int4_matmul", "w8_matmul")


def engine_config(kernels: str, weights, kv: str) -> EngineConfig:
    impl = KERNELS[kernels]
    return EngineConfig(
        model=MODEL,
        load_format="dummy",
        dtype="bfloat16",
        quantization=weights,
        kv_cache_dtype=kv,
        num_slots=8,
        max_model_len=64,
        page_size=16,
        prefill_chunk_size=32,
        max_num_batched_tokens=64,
        attention_impl=impl,
        quant_matmul_impl=impl,
    )


def sweep_one(kernels: str, weights, kv: str, target: str, kinds) -> dict:
    row = dict(kernels=kernels, weights=weights or "bf16", kv=kv, target=target)
    t0 = time.perf_counter()
    e = gpu_programs.abstract_engine(engine_config(kernels, weights, kv), target)
    programs = gpu_programs.warmup_programs(e, kinds)
    failed, mosaic, triton, copied, waits = [], 0, 0, 0, []
    for p in programs:
        try:
            r = gpu_programs.inspect(e, p)
        except Exception as err:  # noqa: BLE001 - a program that does not compile is the finding
            failed.append(f"{p.name}: {type(err).__name__}: {str(err).splitlines()[0][:200]}")
            continue
        mosaic += r.kernel_names.get("kCustomCall", 0)
        triton += sum(c for n, c in r.kernel_names.items() if n.startswith(TRITON_PREFIXES))
        copied += r.weight_bytes_materialized
        if r.host_round_trips and "prompt_logprobs" not in p.name:
            waits.append(p.name)
    row.update(
        programs=len(programs),
        failed=failed,
        mosaic_calls=mosaic,
        triton_kernels=triton,
        weight_bytes_copied=copied,
        host_waits=waits,
        seconds=round(time.perf_counter() - t0, 1),
    )
    wrong_kernels = triton if kernels == "mosaic" else mosaic
    row["ok"] = not failed and not wrong_kernels and not waits
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "experiments/out/gpu_config_sweep"))
    ap.add_argument("--targets", default="h100,h200")
    ap.add_argument("--kernels", default="mosaic,triton", help="of " + ", ".join(KERNELS))
    ap.add_argument("--kinds", default="decode,prefill", help="program kinds (gpu_programs.KINDS)")
    ap.add_argument("--budget_s", type=float, default=3600.0)
    ap.add_argument("--smoke", action="store_true", help="mosaic, INT4 weights, int8 KV, h100")
    opts = ap.parse_args()
    kernels = opts.kernels.split(",")
    configs = list(itertools.product(kernels, WEIGHTS, KV, opts.targets.split(",")))
    if opts.smoke:
        configs = [("mosaic", "int4-rtn", "int8", "h100")]
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    res = dict(model=dataclasses.asdict(MODEL), smoke=opts.smoke, rows=[])
    deadline = time.monotonic() + opts.budget_s
    for kernels, weights, kv, target in configs:
        if time.monotonic() > deadline:
            res["rows"].append(dict(kernels=kernels, weights=weights or "bf16", kv=kv,
                                    target=target, skipped="time budget"))  # fmt: skip
            continue
        row = sweep_one(kernels, weights, kv, target, tuple(opts.kinds.split(",")))
        res["rows"].append(row)
        print(
            f"{target} {kernels:6s} {row['weights']:8s} kv={kv:4s}: {row['programs']} programs, "
            f"{len(row['failed'])} failed, {row['mosaic_calls']} Mosaic calls, "
            f"{row['triton_kernels']} Triton kernels, {row['weight_bytes_copied']} bytes copied, "
            f"{len(row['host_waits'])} waits, {row['seconds']} s, ok {row['ok']}",
            flush=True,
        )
        for f in row["failed"]:
            print(f"    {f}", flush=True)
        (out / "gpu_config_sweep.json").write_text(json.dumps(res, indent=1))
    lines = [
        "| target | kernels | weights | KV | programs | failed | Mosaic calls | Triton kernels "
        "| weight bytes copied | host waits | ok |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        if "skipped" in r:
            lines.append(f"| {r['target']} | {r['kernels']} | {r['weights']} | {r['kv']} "
                         "| skipped |||||||")  # fmt: skip
            continue
        lines.append(
            f"| {r['target']} | {r['kernels']} | {r['weights']} | {r['kv']} | {r['programs']} "
            f"| {len(r['failed'])} | {r['mosaic_calls']} | {r['triton_kernels']} "
            f"| {r['weight_bytes_copied']} | {len(r['host_waits'])} | {'yes' if r['ok'] else 'NO'} |"
        )
    (out / "gpu_config_sweep.md").write_text("\n".join(lines) + "\n")
    (out / "gpu_config_sweep.json").write_text(json.dumps(res, indent=1))
    print("\n".join(lines))
    return 0 if all(r.get("ok", True) for r in res["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
