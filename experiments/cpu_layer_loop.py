"""How a layer loop reads its weights on XLA's CPU backend: `lax.scan` over stacked [L, ...]
weights vs a `fori_loop` of `lax.switch` over per-layer arrays vs a Python-unrolled loop over
per-layer arrays (issue 23's question: what do the per-layer weight slices of a scan cost?).

SmolLM2-135M's MLP shapes (30 layers, hidden 576, MLP 1536, weights [out, in] as the CPU engine
stores them), bf16, M rows per call, median of --reps calls after one untimed; the three variants
give identical outputs (checked) and are timed in turn in one process.

    .venv/bin/python experiments/cpu_layer_loop.py [--rows 8 32] [--reps 9] [--rounds 2]

Name the CPU beside every figure (NOTES.md): these VMs vary between sessions.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.bench.core import cpu_name, median_ms

L, D, I = 30, 576, 1536


def mlp(x, g, u, d):
    gate = jnp.einsum("ni,oi->no", x, g).astype(jnp.float32)
    h = jax.nn.silu(gate).astype(x.dtype) * jnp.einsum("ni,oi->no", x, u)
    return x + jnp.einsum("ni,oi->no", h, d)


@jax.jit
def scanned(x, wg, wu, wd):  # the engine's form: stacked weights, one slice per layer
    return jax.lax.scan(lambda x, w: (mlp(x, *w), None), x, (wg, wu, wd))[0]


@jax.jit
def switched(x, lg, lu, ld):  # per-layer arrays, one branch per layer inside a loop
    branches = [lambda x, i=i: mlp(x, lg[i], lu[i], ld[i]) for i in range(L)]
    return jax.lax.fori_loop(0, L, lambda i, x: jax.lax.switch(i, branches, x), x)


@jax.jit
def unrolled(x, lg, lu, ld):  # per-layer arrays, L copies of the layer in the program
    for i in range(L):
        x = mlp(x, lg[i], lu[i], ld[i])
    return x


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    print(f"CPU: {cpu_name()}, jax {jax.__version__}, bf16")
    ks = jax.random.split(jax.random.key(0), 3)
    shapes = [(L, I, D), (L, I, D), (L, D, I)]
    stacked = [(0.02 * jax.random.normal(k, s)).astype(jnp.bfloat16) for k, s in zip(ks, shapes)]
    per_layer = [list(w) for w in stacked]
    for m in args.rows:
        x = jax.random.normal(jax.random.key(m), (m, D)).astype(jnp.bfloat16)
        outs = [scanned(x, *stacked), switched(x, *per_layer), unrolled(x, *per_layer)]
        assert all(np.array_equal(np.asarray(outs[0]), np.asarray(o)) for o in outs[1:])
        for r in range(args.rounds):
            t = {
                "scan": median_ms(scanned, x, *stacked, reps=args.reps),
                "switch": median_ms(switched, x, *per_layer, reps=args.reps),
                "unrolled": median_ms(unrolled, x, *per_layer, reps=args.reps),
            }
            row = ", ".join(f"{k} {v:.1f} ms" for k, v in t.items())
            print(f"rows={m} round {r}: {row} (scan / unrolled {t['scan'] / t['unrolled']:.2f}x)")


if __name__ == "__main__":
    main()
