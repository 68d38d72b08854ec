"""How much the order of a sequence's pages in the KV pool costs the C++ CPU decode attention:
the same 30-layer decode call (SmolLM2's heads, a 4096-page bf16 pool per layer and head) with
four page tables, alternating in one process, median of 9 rounds:

    random       each row's pages drawn at random (`engine_step_profile.py`, `cpu_attention_ab.py`)
    interleaved  page j of row b is j * B + b: B sequences growing together from the allocator's
                 FIFO free list, the engine's pattern on a fresh server
    runs of 4    rows take 4 consecutive pages at a time, interleaved
    contiguous   each row's pages consecutive

    .venv/bin/python experiments/cpu_attention_page_order.py [--rows 32] [--widths 8 32]

Name the CPU beside every figure (shared/NOTES.md): these VMs vary between sessions.
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import paged_decode_attention as pda
from jaxserve.bench.core import alternating_medians_ms, cpu_name

L, KVH, POOL, PS, D, H = 30, 3, 4096, 16, 64, 9


def tables(b: int, w: int, rng) -> dict[str, np.ndarray]:
    rows, cols = np.arange(b)[:, None], np.arange(w)[None, :]
    runs = (cols // 4) * b * 4 + rows * 4 + cols % 4
    out = {
        "random": np.stack([rng.choice(POOL, w, replace=False) for _ in range(b)]),
        "interleaved": cols * b + rows,
        "runs of 4": runs,
        "contiguous": rows * w + cols,
    }
    return {name: jnp.asarray(t % POOL, jnp.int32) for name, t in out.items()}


@jax.jit
def decode(q, k, v, lens, pt):
    layers = jnp.arange(L, dtype=jnp.int32)
    return jax.lax.scan(
        lambda c, li: (c, pda.paged_decode_attention(q, k, v, lens, pt, li)), 0, layers
    )[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--widths", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--reps", type=int, default=9)
    a = ap.parse_args()
    assert pda.available(), pda.build_error()
    print(f"CPU: {cpu_name()}")
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((L, KVH, POOL, PS, D), np.float32), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((L, KVH, POOL, PS, D), np.float32), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((a.rows, H, D), np.float32), jnp.bfloat16)
    for w in a.widths:
        lens = jnp.full((a.rows,), w * PS - 2, jnp.int32)
        fns = {
            name: functools.partial(decode, q, k, v, lens, pt)
            for name, pt in tables(a.rows, w, rng).items()
        }
        ms = alternating_medians_ms(fns, reps=a.reps)
        print(
            json.dumps(
                {"rows": a.rows, "ctx": w * PS - 2, **{n: round(t, 2) for n, t in ms.items()}}
            )
        )


if __name__ == "__main__":
    main()
