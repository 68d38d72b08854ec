"""Three forms of the per-row LoRA product, delta[b] = (x[b] @ a[slot[b]]) @ b[slot[b]], timed
beside each other on one weight shape (bf16, jitted, the same inputs, outputs checked equal):

    masked    every slot's product for every row, other slots' columns masked to zero: two
              dense GEMMs [B, in] @ [in, N*R], [B, N*R] @ [N*R, out] (what `layers/lora.py` runs)
    gather    each row gathers its slot's factors (vLLM's BGMV shape): [B, in, R] and [B, R, out]
              gathered, then batched matvecs
    ragged    rows sorted by slot, `lax.ragged_dot` over the groups (Punica's SGMV shape), one
              zero slot for rows without an adapter, unsorted after

    python experiments/lora_delta_forms.py [--rows 32] [--slots 8] [--rank 16] [--repeats 30]

Prints, per shape and number of distinct adapters in the batch, each form's median microseconds
and its ratio to `masked`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.layers import lora

SHAPES = {  # (in, out)
    "SmolLM2 q_proj 576x576": (576, 576),
    "SmolLM2 down_proj 1536x576": (1536, 576),
    "Llama-3-8B q_proj 4096x4096": (4096, 4096),
    "Llama-3-8B down_proj 14336x4096": (14336, 4096),
}


def gather(x, a, b, rows):
    """x [B, in]; a [in, N, R]; b [N, R, out]; rows i32[B] (-1 none)."""
    s = jnp.maximum(rows, 0)
    ar = jnp.moveaxis(a, 1, 0)[s]  # (B, in, R)
    h = jnp.einsum("bi,bir->br", x, ar.astype(x.dtype))
    h = jnp.where((rows >= 0)[:, None], h, 0)
    return jnp.einsum("br,bro->bo", h, b[s].astype(x.dtype))


def ragged(x, a, b, rows):
    n = a.shape[1]
    g = jnp.where(rows >= 0, rows, n)  # group n: a zero slot for rows without an adapter
    order = jnp.argsort(g)
    sizes = jnp.bincount(g, length=n + 1).astype(jnp.int32)
    az = jnp.concatenate([jnp.moveaxis(a, 1, 0), jnp.zeros_like(a[:, :1]).swapaxes(0, 1)], 0)
    bz = jnp.concatenate([b, jnp.zeros_like(b[:1])], 0)
    h = jax.lax.ragged_dot(x[order], az.astype(x.dtype), sizes)  # (B, R)
    y = jax.lax.ragged_dot(h, bz.astype(x.dtype), sizes)  # (B, out)
    return jnp.zeros_like(y).at[order].set(y)


def masked(x, a, b, rows):
    return lora.delta(x[:, None], a, b, rows)[:, 0]


FORMS = {"masked": masked, "gather": gather, "ragged": ragged}


def timed(fn, args, repeats: int) -> float:
    fn(*args).block_until_ready()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args).block_until_ready()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    n, r, rows = args.slots, args.rank, args.rows
    print(
        f"jax {jax.__version__}, {jax.devices()[0].device_kind}; rows {rows}, slots {n}, rank {r}"
    )
    print("| shape | adapters in the batch | " + " | ".join(f"{f} us" for f in FORMS) + " | "
          + " | ".join(f"{f} / masked" for f in FORMS if f != "masked") + " |")  # fmt: skip
    print("|---" * (2 + 2 * len(FORMS) - 1) + "|")
    jitted = {name: jax.jit(fn) for name, fn in FORMS.items()}
    for label, (d_in, d_out) in SHAPES.items():
        a = jnp.asarray(rng.normal(0, d_in**-0.5, (d_in, n, r)), jnp.bfloat16)
        b = jnp.asarray(rng.normal(0, r**-0.5, (n, r, d_out)), jnp.bfloat16)
        x = jnp.asarray(rng.normal(size=(rows, d_in)), jnp.bfloat16)
        for k in (1, 4, n):
            slots = jnp.asarray([i % k if i % 4 else -1 for i in range(rows)], jnp.int32)
            outs = {f: np.asarray(fn(x, a, b, slots), np.float32) for f, fn in jitted.items()}
            for f in FORMS:
                np.testing.assert_allclose(outs[f], outs["masked"], rtol=0.05, atol=0.05)
            us = {f: timed(fn, (x, a, b, slots), args.repeats) for f, fn in jitted.items()}
            ratios = " | ".join(f"{us[f] / us['masked']:.2f}x" for f in FORMS if f != "masked")
            print(f"| {label} | {k} | " + " | ".join(f"{us[f]:.0f}" for f in FORMS)
                  + f" | {ratios} |")  # fmt: skip


if __name__ == "__main__":
    main()
