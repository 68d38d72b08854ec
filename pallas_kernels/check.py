"""Lowers every Pallas kernel, in every configuration the engine uses, for CUDA on an abstract H200.

    python -m pallas_kernels.check [--filter SUBSTRING] [--verbose]

No GPU is needed: the kernels are traced with `ShapeDtypeStruct`s under an abstract mesh whose
device is an "NVIDIA H200" and lowered with `lowering_platforms=("cuda",)`, which runs the Pallas
-> Triton IR lowering (block shapes, dtypes, supported primitives). It does not run Triton's own
compiler to PTX, which happens when XLA compiles on a real GPU (`experiments/gpu_kernels.py`).

Each kernel file defines `lowering_cases() -> list[KernelCheck]` (`lowering.py`, a leaf the kernels
import); adding a kernel file to the registry is one line in `KERNEL_MODULES`. The paged-attention
kernels' cases include the sliding-window models (`triton_common.WINDOW_MODEL_HEADS`: a traced
window argument, Gemma 2's soft-cap and query_pre_attn_scalar scale), named ".../window[/softcapN]". Prints a table and exits non-zero if any case fails.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

from pallas_kernels import int4_matmul, w8_matmul
from pallas_kernels.attention import triton_decode, triton_prefill
from pallas_kernels.lowering import KernelCheck, h200_mesh, lower_for_h200

__all__ = ["KERNEL_MODULES", "KernelCheck", "collect", "h200_mesh", "lower_for_h200", "run"]

KERNEL_MODULES = (triton_decode, triton_prefill, int4_matmul, w8_matmul)


def collect(modules=KERNEL_MODULES) -> list[KernelCheck]:
    checks = []
    for module in modules:
        checks.extend(module.lowering_cases())
    return checks


def run(checks: list[KernelCheck], verbose: bool = False) -> list[tuple[str, bool, float, str]]:
    """Lowers each case: [(name, ok, seconds, error line)]."""
    results = []
    for c in checks:
        t0 = time.perf_counter()
        try:
            lower_for_h200(c)
            ok, err = True, ""
        except Exception as e:  # noqa: BLE001 - every failure is reported in the table
            ok, err = False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            if verbose:
                traceback.print_exc()
        results.append((c.name, ok, time.perf_counter() - t0, err))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--filter", default="", help="only cases whose name contains this")
    parser.add_argument("--verbose", action="store_true", help="print tracebacks of failures")
    opts = parser.parse_args(argv)
    checks = [c for c in CHECKS if opts.filter in c.name]
    if not checks:
        print(f"no lowering case matches {opts.filter!r}")
        return 1
    results = run(checks, opts.verbose)
    width = max(len(r[0]) for r in results)
    print(f"{'case':<{width}}  result  seconds")
    for name, ok, secs, err in results:
        print(f"{name:<{width}}  {'ok' if ok else 'FAIL':<6}  {secs:7.2f}  {err}")
    failed = sum(not r[1] for r in results)
    print(f"{len(results) - failed}/{len(results)} cases lowered for CUDA (abstract NVIDIA H200)")
    return 1 if failed else 0


CHECKS: list[KernelCheck] = collect()

if __name__ == "__main__":
    sys.exit(main())
