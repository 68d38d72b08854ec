"""Why the GPU engine compiles float weights with cuBLAS and no dot merging (RESULTS.md 54b): one
Llama-3-8B bf16 decode forward (8 slots, 4,096 positions) compiled for an H100 on this CPU under
several XLA option sets and with the layer loop unrolled, each read back by the GPU inspector.

    python experiments/gpu_layer_loop_ab.py [--out FILE.jsonl]

Variants (weight MiB written a step, kernels, host launches, compile seconds):
    defaults            XLA's own options (Triton GEMMs)
    gemm_fusion_v2      xla_gpu_experimental_gemm_fusion_v2
    all_triton          xla_gpu_experimental_all_fusions_with_triton
    cublas              xla_gpu_enable_triton_gemm=False (cuBLAS + dynamic-slice fusion)
    cublas_no_merge     the same and xla_gpu_dot_merger_threshold_mb=0 (the engine's choice,
                        without its CUDA-graph option)
    unrolled            XLA's defaults, `lax.scan(..., unroll=True)` over the layers (static
                        slices); run in a process of its own, since jax caches the scan's trace
Needs the gpu-compile extra. No GPU: compiled programs, not timings.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys

from jaxserve.bench import deviceless

deviceless.prepare()

import jax  # noqa: E402

from jaxserve.bench import gpu_programs  # noqa: E402
from jaxserve.config import EngineConfig  # noqa: E402

OFF = "False"
VARIANTS = {
    "defaults": {},
    "gemm_fusion_v2": {"xla_gpu_experimental_gemm_fusion_v2": "True"},
    "all_triton": {"xla_gpu_experimental_all_fusions_with_triton": "True"},
    "cublas": {"xla_gpu_enable_triton_gemm": OFF},
    "cublas_no_merge": {"xla_gpu_enable_triton_gemm": OFF, "xla_gpu_dot_merger_threshold_mb": "0"},
    "unrolled": {},
}


@contextlib.contextmanager
def unrolled_scans():
    """Every lax.scan traced meanwhile is unrolled (the decode forward's one scan: the layers)."""
    scan = jax.lax.scan
    jax.lax.scan = lambda *a, **k: scan(*a, **{**k, "unroll": True})
    try:
        yield
    finally:
        jax.lax.scan = scan


def measure(variant: str) -> dict:
    config = EngineConfig(
        model="llama3-8b", num_slots=8, max_model_len=4096, num_pages=4096, dtype="bfloat16"
    )
    engine = gpu_programs.abstract_engine(config, "h100")
    program = next(
        p for p in gpu_programs.warmup_programs(engine, ("decode",)) if "width=256" in p.name
    )
    ctx = unrolled_scans() if variant == "unrolled" else contextlib.nullcontext()
    with ctx:
        r = gpu_programs.inspect(engine, program, VARIANTS[variant])
    return {
        "variant": variant,
        "options": VARIANTS[variant],
        "weight_MiB": r.weight_bytes_materialized / 2**20,
        "kernels_per_layer": r.per_layer,
        "kernels_per_step": r.kernels,
        "host_launches": r.host_launches,
        "compile_s": round(r.compile_s, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write one JSON line per variant here")
    parser.add_argument("--only", choices=sorted(VARIANTS), default=None)
    args = parser.parse_args()
    if args.only:
        print(json.dumps(measure(args.only)))
        return
    rows = []
    for variant in VARIANTS:
        if variant == "unrolled":  # a fresh process: no cached trace of the rolled scan
            proc = subprocess.run(
                [sys.executable, __file__, "--only", variant],
                capture_output=True,
                text=True,
                check=True,
            )
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        else:
            rows.append(measure(variant))
        r = rows[-1]
        print(
            f"{r['variant']:>16} | {r['weight_MiB']:>8.0f} MiB | {r['kernels_per_step']} "
            f"kernels/step, {r['kernels_per_layer']} per layer (None: no layer loop) | "
            f"{r['host_launches']} host launches | {r['compile_s']} s",
            flush=True,
        )
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
