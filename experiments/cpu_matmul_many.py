"""One C++ matmul call for the weights that share an input (`cpu_matmul.matmul_many`) against one
call per weight, on SmolLM2-135M's layer: q, k, v (576, 192, 192 x 576) and gate, up
(1536 x 576), 30 layers under `lax.scan`, each layer's weights read in place from the stacks, as
the engine's decode step runs them. The two sides alternate in one process
(`alternating_medians_ms`); the outputs must be bitwise equal.

    .venv/bin/python experiments/cpu_matmul_many.py [--rows 1 4 8 16 32] [--reps 15] [--json FILE]

Name the CPU beside every figure (shared/NOTES.md): these VMs vary between sessions.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import matmul as cpu_matmul
from jaxserve.bench.core import alternating_medians_ms, cpu_name, write_rows_json

LAYERS, D, KV, INTER = 30, 576, 192, 1536
GROUPS = (("wq", "wk", "wv"), ("w_gate", "w_up"))
OUT = {"wq": D, "wk": KV, "wv": KV, "w_gate": INTER, "w_up": INTER}


def scan(fused: bool):
    @jax.jit
    def run(x, ws):
        def body(carry, li):
            outs = []
            for group in GROUPS:
                stacks = [ws[n] for n in group]
                if fused:
                    outs += cpu_matmul.matmul_many(x, stacks, li)
                else:
                    outs += [cpu_matmul.matmul(x, w, li) for w in stacks]
            return carry, outs

        return jax.lax.scan(body, 0, jnp.arange(LAYERS, dtype=jnp.int32))[1]

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    assert cpu_matmul.available(), cpu_matmul.build_error()
    print(f"CPU: {cpu_name()}; kernel path: {cpu_matmul.path()}")
    rng = np.random.default_rng(0)
    ws = {
        n: jnp.asarray(rng.normal(size=(LAYERS, out, D)) / np.sqrt(D), jnp.bfloat16)
        for n, out in OUT.items()
    }
    sides = {"one call per weight": scan(False), "matmul_many": scan(True)}
    rows = []
    for m in a.rows:
        x = jnp.asarray(rng.normal(size=(m, D)), jnp.bfloat16)
        outs = {s: [np.asarray(y) for y in f(x, ws)] for s, f in sides.items()}
        same = all(np.array_equal(p, q) for p, q in zip(*outs.values()))
        ms = alternating_medians_ms(sides, x, ws, reps=a.reps)
        separate, fused = ms["one call per weight"], ms["matmul_many"]
        row = {
            "rows": m, "separate_ms": round(separate, 2), "fused_ms": round(fused, 2),
            "fused_over_separate": round(fused / separate, 3), "bitwise_equal": same,
        }  # fmt: skip
        print(json.dumps(row))
        rows.append(row)
    write_rows_json(a.json, rows)


if __name__ == "__main__":
    main()
