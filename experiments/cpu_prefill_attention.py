"""The CPU prefill attention: the C++ kernel (`cpu_kernels/paged_decode_attention.py`'s
`paged_prefill_attention`, the default where it builds, RESULTS.md section 39), the XLA form of
`layers/ragged_attention.prefill_attention` (the fallback), and the layout that had until section
38 (scores as one dot q . K^T, softmax along the keys' minor axis): time per call, and whether a
chunk's output changes with the page-table width (bitwise mismatches between widths W, 2W, 4W for
the same queries and keys; the engine's rows must not depend on the other rows of their step, nor
on a prefix-cache hit's narrower step).

SmolLM2's heads (9 query heads, 3 KV heads, head dim 64), pages of 16, bf16 pools, 64-token chunks
ending at the last page; median of --reps calls of one layer, the two layouts in turn.

    .venv/bin/python experiments/cpu_prefill_attention.py [--reps 9] [--draws 10]

Name the CPU beside every figure (shared/NOTES.md): these VMs vary between sessions.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import paged_decode_attention as cpu_attention
from jaxserve.bench.core import alternating_medians_ms, cpu_name
from jaxserve.layers.ragged_attention import prefill_attention
from pallas_kernels.paged_common import soft_cap

KVH, G, D, PS = 3, 3, 64, 16


def transposed_prefill_attention(q, k_pages, v_pages, positions, seq_lens, page_table, layer):
    """The layout before section 38 (no window, no scales): scores [B, KVH, G*T, S] = q . K^T."""
    b, t, h, d = q.shape
    kvh, ps = k_pages.shape[1], k_pages.shape[3]
    g, s_len = h // kvh, page_table.shape[1] * ps

    def gather(pages):
        x = pages[layer][:, page_table].astype(jnp.float32)
        return jnp.swapaxes(x.reshape(kvh, b, s_len, d), 0, 1)

    k, v = gather(k_pages), gather(v_pages)
    qf = q.astype(jnp.float32).reshape(b, t, kvh, g, d).transpose(0, 2, 3, 1, 4)
    batch = ((0, 1), (0, 1))
    s = jax.lax.dot_general(qf.reshape(b, kvh, g * t, d), k, (((3,), (3,)), batch))
    s = soft_cap(s / jnp.sqrt(jnp.float32(d)), None).reshape(b, kvh, g, t, s_len)
    s_idx = jnp.arange(s_len)
    visible = (s_idx[None, None, :] <= positions[:, :, None]) & (
        s_idx[None, None, :] < seq_lens[:, None, None]
    )
    s = jnp.where(visible[:, None, None], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(visible[:, None, None], jnp.exp(s - m), 0.0)
    denom = jnp.sum(p, axis=-1)
    o = jax.lax.dot_general(p.reshape(b, kvh, g * t, s_len), v, (((3,), (2,)), batch))
    o = o.reshape(b, kvh, g, t, d) / jnp.where(denom > 0, denom, 1.0)[..., None]
    return o.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d).astype(q.dtype)


LAYOUTS = {
    "cpu_kernel": cpu_attention.paged_prefill_attention,
    "keys_as_rows (ragged)": prefill_attention,
    "transposed (before 38)": transposed_prefill_attention,
}


def case(rng, b, t, w):
    pool = b * w * 4 + 4
    k = jnp.asarray(rng.normal(size=(2, KVH, pool, PS, D)), jnp.bfloat16)
    v = jnp.asarray(rng.normal(size=(2, KVH, pool, PS, D)), jnp.bfloat16)
    q = jnp.asarray(rng.normal(size=(b, t, KVH * G, D)), jnp.bfloat16)
    start = w * PS - t - 2  # the chunk ends on the row's last page
    pos = jnp.asarray(start + np.arange(t)[None].repeat(b, 0), jnp.int32)
    lens = jnp.full((b,), start + t, jnp.int32)
    table = jnp.asarray(rng.permutation(pool)[: b * w * 4].reshape(b, w * 4), jnp.int32)
    return q, k, v, pos, lens, table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--draws", type=int, default=10)
    a = ap.parse_args()
    print(f"CPU: {cpu_name()}")
    fns = {name: jax.jit(f) for name, f in LAYOUTS.items()}
    rng = np.random.default_rng(0)
    for b, t, w in [(1, 64, 8), (8, 64, 8), (8, 64, 32), (2, 64, 32)]:
        q, k, v, pos, lens, table = case(rng, b, t, w)
        args = (q, k, v, pos, lens, table[:, :w], jnp.int32(1))
        ms = alternating_medians_ms(fns, *args, reps=a.reps)
        row = {"rows": b, "chunk": t, "pages": w}
        row.update({f"{n} ms": round(x, 3) for n, x in ms.items()})
        print(json.dumps(row))
    for name, f in fns.items():  # the same chunk at page-table widths W, 2W, 4W
        bad = 0
        for _ in range(a.draws):
            q, k, v, pos, lens, table = case(rng, 2, 20, 2)
            outs = [np.asarray(f(q, k, v, pos, lens, table[:, :w], 1)) for w in (2, 4, 8)]
            bad += sum(int((o != outs[0]).sum()) for o in outs[1:])
        print(json.dumps({"layout": name, "draws": a.draws, "width_mismatches": bad}))


if __name__ == "__main__":
    main()
