"""The C++ CPU paged attention (`cpu_kernels/paged_decode_attention.cc`) against the same file at
another git revision, in one process: decode steps and prefill chunks on SmolLM2's attention shapes
(9 query heads, 3 KV heads, head dim 64, pages of 16), 30 layers under `lax.scan` over a bf16 pool
of 4096 pages per layer and head (1.5 GB, the engine's default for 32 slots) at random pages, as
the engine reads it. Median of --reps alternating calls per side (`alternating_medians_ms`).

    .venv/bin/python experiments/cpu_attention_ab.py --baseline REV [--reps 9] [--json FILE]

Name the CPU beside every figure (shared/NOTES.md): these VMs vary between sessions.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import paged_decode_attention as pda
from cpu_kernels.build import FfiTarget, source_at_revision
from jaxserve.bench.core import alternating_medians_ms, cpu_name, write_rows_json

L, KVH, G, D, PS, POOL = 30, 3, 3, 64, 16, 4096
H = KVH * G


def targets(rev: str | None) -> tuple[str, str]:
    """The (decode, prefill) FFI target names of this tree's kernel, or of revision `rev`'s
    source registered under its own names."""
    if rev is None:
        assert pda.available(), pda.build_error()
        return pda.TARGET, pda.PREFILL_TARGET
    path = source_at_revision(rev, "paged_decode_attention.cc")
    names = (f"jaxserve_paged_decode_{rev}", f"jaxserve_paged_prefill_{rev}")
    for name, symbol in zip(
        names, ("JaxservePagedDecodeAttention", "JaxservePagedPrefillAttention")
    ):
        target = FfiTarget(path, name, symbol)
        assert target.error() is None, target.error()
    return names


def scan_fn(target: str, out_shape):
    """30 layers of one FFI call (decode or prefill handler), the layer index traced."""

    @jax.jit
    def run(q, k, v, index):
        empty = jnp.zeros((0,), jnp.float32)
        call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(out_shape, jnp.bfloat16))

        def body(c, li):
            out = call(q, k, v, empty, empty, *index, li, jnp.int32(0),
                       scale=np.float32(D**-0.5), softcap=np.float32(0.0))  # fmt: skip
            return c, out

        return jax.lax.scan(body, 0, jnp.arange(L, dtype=jnp.int32))[1]

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True, help="a git revision: its kernel as the B side")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    sides = {"now": targets(None), "baseline": targets(a.baseline)}
    print(f"CPU: {cpu_name()}")
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((L, KVH, POOL, PS, D), np.float32), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((L, KVH, POOL, PS, D), np.float32), jnp.bfloat16)
    rows = []
    # (kind, rows, tokens per row, context): decode steps, then prefill chunks ending at ctx
    cases = [("decode", 8, 1, 126), ("decode", 32, 1, 126), ("decode", 32, 1, 510),
             ("prefill", 1, 64, 126), ("prefill", 8, 64, 510)]  # fmt: skip
    for kind, b, t, ctx in cases:
        w = -(-ctx // PS)
        pt = jnp.asarray(
            np.stack([rng.choice(POOL, w, replace=False) for _ in range(b)]), jnp.int32
        )
        lens = jnp.full((b,), ctx, jnp.int32)
        if kind == "decode":
            q = jnp.asarray(rng.standard_normal((b, H, D), np.float32), jnp.bfloat16)
            index = (lens, pt)
        else:
            q = jnp.asarray(rng.standard_normal((b, t, H, D), np.float32), jnp.bfloat16)
            pos = jnp.asarray(np.broadcast_to(np.arange(ctx - t, ctx), (b, t)), jnp.int32)
            index = (pos, lens, pt)
        fns = {s: scan_fn(names[kind == "prefill"], q.shape) for s, names in sides.items()}
        got = {s: np.asarray(f(q, k, v, index), np.float32) for s, f in fns.items()}
        diff = float(np.max(np.abs(got["now"] - got["baseline"])))
        ms = alternating_medians_ms(fns, q, k, v, index, reps=a.reps)
        row = {
            "case": kind, "rows": b, "tokens": t, "ctx": ctx,
            "now_ms": round(ms["now"], 2), "baseline_ms": round(ms["baseline"], 2),
            "now_over_baseline": round(ms["now"] / ms["baseline"], 3), "max_abs_diff": diff,
        }  # fmt: skip
        print(json.dumps(row))
        rows.append(row)
    write_rows_json(a.json, rows)


if __name__ == "__main__":
    main()
