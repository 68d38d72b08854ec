"""SmolLM2-shaped decode attention on this CPU: the C++ kernel (`cpu_kernels/`) vs the XLA 'ragged'
path (`jaxserve/layers/ragged_attention.py`), alone, in one process, called in turn (ABBA).

Every slot holds --ctx cached tokens in scattered pages of --page_size (a random permutation of the
pool, as a long-running engine's pages are), bf16 pools [30 layers, 3 KV heads, P, ps, 64], 9 query
heads. Two timings per variant, median of --reps calls:

    one layer   one call at layer 3
    30 layers   `lax.scan` over the 30 layers, each reading its own layer of the pool

    .venv/bin/python experiments/cpu_decode_attention.py [--slots 32] [--ctx 126 510] [--reps 20]

Also prints the largest difference between the two outputs. Name the CPU beside every figure.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import paged_decode_attention as cpu_attention
from jaxserve.bench.core import cpu_name, median_ms, write_rows_json
from jaxserve.layers.ragged_attention import ragged_decode_attention

LAYERS, KVH, HEADS, D = 30, 3, 9, 64


def variants(num_flat: int) -> dict:
    return {
        "cpu_kernel": lambda q, k, v, n, pt, li: cpu_attention.paged_decode_attention(
            q, k, v, n, pt, li
        ),
        "ragged": lambda q, k, v, n, pt, li: ragged_decode_attention(q, k, v, n, pt, num_flat, li),
    }


def stacked(f):
    """f over the 30 layers under `lax.scan`, each call reading its own layer of the pool."""

    def run(q, k, v, n, pt):
        def body(c, li):
            return c, f(q, k, v, n, pt, li)

        return jax.lax.scan(body, 0, jnp.arange(LAYERS))[1]

    return jax.jit(run)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--ctx", type=int, nargs="+", default=[126, 510])
    ap.add_argument("--page_size", type=int, default=8)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    assert cpu_attention.available(), cpu_attention.build_error()
    print(f"CPU: {cpu_name()}")
    rng = np.random.default_rng(0)
    rows = []
    for ctx in a.ctx:
        b, ps = a.slots, a.page_size
        w = -(-ctx // ps)
        pool = b * w + 8
        shape = (LAYERS, KVH, pool, ps, D)
        k = jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
        v = jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
        q = jnp.asarray(rng.normal(size=(b, HEADS, D)), jnp.bfloat16)
        pt = jnp.asarray(rng.permutation(pool)[: b * w].reshape(b, w), jnp.int32)
        lens = jnp.full((b,), ctx, jnp.int32)
        fns = variants(b * w)
        one = {n: jax.jit(lambda *x, f=f: f(*x, jnp.int32(3))) for n, f in fns.items()}

        scan = {n: stacked(f) for n, f in fns.items()}
        args = (q, k, v, lens, pt)
        diff = float(
            jnp.max(
                jnp.abs(
                    one["cpu_kernel"](*args).astype(jnp.float32)
                    - one["ragged"](*args).astype(jnp.float32)
                )
            )
        )
        row = {"slots": b, "ctx": ctx, "page_size": ps, "max_abs_diff": diff}
        for order in (("cpu_kernel", "ragged"), ("ragged", "cpu_kernel")):  # ABBA
            for name in order:
                row.setdefault(f"{name}_one_layer_ms", []).append(
                    median_ms(one[name], *args, reps=a.reps)
                )
                row.setdefault(f"{name}_30_layers_ms", []).append(
                    median_ms(scan[name], *args, reps=a.reps)
                )
        row = {
            k: (round(float(np.median(v)), 3) if isinstance(v, list) else v) for k, v in row.items()
        }
        print(json.dumps(row))
        rows.append(row)
    write_rows_json(a.json, rows)


if __name__ == "__main__":
    main()
