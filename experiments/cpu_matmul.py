"""The C++ CPU matmul (`cpu_kernels/matmul.py`) vs XLA's dot on SmolLM2's layer shapes, as the
engine runs them: 30 layers under `lax.scan`, the kernel reading each layer of the stacked
[L, out, in] bf16 weight in place, XLA slicing it out of the stack (the engine's form before).
Median of --reps calls of the 30-layer scan, per layer; the two forms alternate in one process.
--baseline REV adds a third side, alternating with them: the kernel built from git revision REV's
`cpu_kernels/matmul.cc` (an A/B of a kernel change in one process).

    .venv/bin/python experiments/cpu_matmul.py [--rows 8 32 128] [--reps 11] [--baseline REV] [--json FILE]

Name the CPU beside every figure (shared/NOTES.md): these VMs vary between sessions.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import matmul as cpu_matmul
from cpu_kernels.build import FfiTarget, source_at_revision
from jaxserve.bench.core import alternating_medians_ms, cpu_name, write_rows_json

LAYERS = 30
SHAPES = {  # name: (out, in), SmolLM2-135M
    "q/o (576x576)": (576, 576),
    "k/v (192x576)": (192, 576),
    "gate/up (1536x576)": (1536, 576),
    "down (576x1536)": (576, 1536),
}


@jax.jit
def xla_scan(x, w):  # the engine's form with matmul_impl='xla'
    return jax.lax.scan(lambda c, wl: (c, jnp.einsum("ni,oi->no", x, wl)), 0, w)[1]


@jax.jit
def kernel_scan(x, w):  # matmul_impl='cpu_kernel': the stack whole, the layer index traced
    layers = jnp.arange(w.shape[0])
    return jax.lax.scan(lambda c, li: (c, cpu_matmul.matmul(x, w, li)), 0, layers)[1]


def baseline_scan(rev: str):
    """kernel_scan with the kernel of git revision `rev`, registered as its own FFI target."""
    path = source_at_revision(rev, "matmul.cc")
    target = FfiTarget(path, f"jaxserve_matmul_{rev}", "JaxserveMatmul")
    assert target.error() is None, target.error()

    @jax.jit
    def scan(x, w):
        call = jax.ffi.ffi_call(
            target.target, jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), x.dtype)
        )
        layers = jnp.arange(w.shape[0], dtype=jnp.int32)
        return jax.lax.scan(lambda c, li: (c, call(x, w, li)), 0, layers)[1]

    return scan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256])
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--baseline", default=None, help="a git revision: its kernel as a third side")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    sides = {"xla": xla_scan, "kernel": kernel_scan}
    if a.baseline:
        sides["baseline"] = baseline_scan(a.baseline)
    assert cpu_matmul.available(), cpu_matmul.build_error()
    print(f"CPU: {cpu_name()}; kernel path: {cpu_matmul.path()}")
    rng = np.random.default_rng(0)
    rows = []
    for name, (n, k) in SHAPES.items():
        w = jnp.asarray(rng.normal(size=(LAYERS, n, k)) / np.sqrt(k), jnp.bfloat16)
        for m in a.rows:
            x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
            got, want = kernel_scan(x, w), xla_scan(x, w)
            diff = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
            ms = alternating_medians_ms(sides, x, w, reps=a.reps)
            xla_us, kernel_us = (1e3 * ms[side] / LAYERS for side in ("xla", "kernel"))
            row = {
                "shape": name,
                "rows": m,
                "xla_us_per_layer": round(xla_us, 1),
                "kernel_us_per_layer": round(kernel_us, 1),
                "kernel_over_xla": round(kernel_us / xla_us, 2),
                "kernel_gflops": round(2 * m * n * k / kernel_us / 1e3, 1),
                "max_abs_diff": diff,
            }
            if a.baseline:
                base_us = 1e3 * ms["baseline"] / LAYERS
                row["baseline_us_per_layer"] = round(base_us, 1)
                row["kernel_over_baseline"] = round(kernel_us / base_us, 2)
            print(json.dumps(row))
            rows.append(row)
    write_rows_json(a.json, rows)


if __name__ == "__main__":
    main()
