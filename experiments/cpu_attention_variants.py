r"""Variants of the CPU decode attention (`layers.ragged_attention`), timed alone (RESULTS 20c).

SmolLM2's shapes (30 layers under `lax.scan`, 9 query / 3 KV heads of 64, 16-token pages, a
4,096-page bf16 pool), 32 rows each with `ctx` cached tokens on random pages. Each variant is the
engine's ragged attention with one thing changed; all must equal the engine's ('current') output.

    current   jaxserve.layers.ragged_attention.ragged_decode_attention as it is
    bias      an additive -inf mask on the scores instead of two selects
    bf16dot   K/V stay bf16 into the two small dots (f32 accumulation) instead of an f32 copy
    reduce    multiply-and-reduce in place of the two small dots

--num_flat overrides the flat-page bucket F (default: `Resolved.flat_buckets`, powers of two), to see how
the cost follows F at fixed live pages. Median of --reps calls, variants in turn in one process.

    .venv/bin/python experiments/cpu_attention_variants.py --ctx=126,510
    .venv/bin/python experiments/cpu_attention_variants.py --ctx=170 --variants=current \
        --num_flat=352,384,512
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from jaxserve.layers.ragged_attention import ragged_decode_attention
from jaxserve.resolve import bucket_for, pow2_buckets

_CTX = flags.DEFINE_list("ctx", ["126", "510"], "Cached tokens per row.")
_VARIANTS = flags.DEFINE_list("variants", ["current", "bias", "bf16dot", "reduce"], "Variants.")
_NUM_FLAT = flags.DEFINE_list(
    "num_flat", [], "Flat-page buckets to force (default: powers of two, as the engine)."
)
_REPS = flags.DEFINE_integer("reps", 7, "Timed calls per point (median).")

L, B, H, KVH, D, PS, P, W = 30, 32, 9, 3, 64, 16, 4096, 64


def variant(name: str):
    """The ragged attention with one change (see the module docstring)."""

    def fn(q, k_pages, v_pages, kv_lens, page_table, f, layer):
        b, h, d = q.shape
        g = h // KVH
        kv_lens = jnp.clip(kv_lens, 0, W * PS)
        n_pages = (kv_lens + PS - 1) // PS
        ends = jnp.cumsum(n_pages)
        owner = jnp.searchsorted(ends, jnp.arange(f, dtype=ends.dtype), side="right")
        row = jnp.minimum(owner, b - 1)
        j = jnp.arange(f) - (ends - n_pages)[row]
        live = owner < b
        page = jnp.where(live, page_table[row, jnp.clip(j, 0, W - 1)], 0)
        qf = q.astype(jnp.float32).reshape(b, KVH, g, d)[row]  # (F, KVH, G, D)
        tok = j[:, None] * PS + jnp.arange(PS)[None, :]
        visible = (live[:, None] & (tok < kv_lens[row][:, None]))[:, None, None, :]
        k, v = k_pages[layer][:, page], v_pages[layer][:, page]  # (KVH, F, ps, D) bf16
        if name == "bf16dot":
            s = jnp.einsum(
                "fkgd,kfsd->fkgs", qf.astype(k.dtype), k, preferred_element_type=jnp.float32
            )
        elif name == "reduce":
            k = jnp.swapaxes(k, 0, 1).astype(jnp.float32)  # (F, KVH, ps, D)
            v = jnp.swapaxes(v, 0, 1).astype(jnp.float32)
            s = jnp.sum(qf[:, :, :, None, :] * k[:, :, None, :, :], axis=-1)
        else:
            k, v = k.astype(jnp.float32), v.astype(jnp.float32)
            s = jnp.einsum("fkgd,kfsd->fkgs", qf, k)
        if name == "bias":
            s = s * (1.0 / math.sqrt(d)) + jnp.where(visible, 0.0, -jnp.inf)
        else:
            s = jnp.where(visible, s / jnp.sqrt(jnp.float32(d)), -jnp.inf)
        seg = dict(segment_ids=owner, num_segments=b + 1, indices_are_sorted=True)
        m = jax.ops.segment_max(jnp.max(s, axis=-1), **seg)[:b]
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        p = jnp.exp(s - m[row][..., None])
        if name != "bias":
            p = jnp.where(visible, p, 0.0)
        denom = jax.ops.segment_sum(jnp.sum(p, axis=-1), **seg)[:b]
        if name == "bf16dot":
            o = jnp.einsum(
                "fkgs,kfsd->fkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32
            )
        elif name == "reduce":
            o = jnp.sum(p[..., None] * v[:, :, None, :, :], axis=-2)
        else:
            o = jnp.einsum("fkgs,kfsd->fkgd", p, v)
        o = jax.ops.segment_sum(o, **seg)[:b] / jnp.where(denom > 0, denom, 1.0)[..., None]
        return o.reshape(b, h, d).astype(q.dtype)

    return fn


def layers(impl, q, kp, vp, kv_lens, pt, f):
    """The attention of every layer in a `lax.scan`, each layer's output feeding the next query."""

    def body(x, layer):
        return (x + 0.01 * impl(x, kp, vp, kv_lens, pt, f, layer)).astype(x.dtype), None

    return jax.lax.scan(body, q, jnp.arange(L))[0]


def main(argv):
    del argv
    impls = {
        n: (ragged_decode_attention if n == "current" else variant(n)) for n in _VARIANTS.value
    }
    run = jax.jit(layers, static_argnums=(0, 6))
    rng = np.random.default_rng(0)
    kp = jnp.asarray(rng.standard_normal((L, KVH, P, PS, D)), jnp.bfloat16)
    vp = jnp.asarray(rng.standard_normal((L, KVH, P, PS, D)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((B, H, D)), jnp.bfloat16)
    for ctx in map(int, _CTX.value):
        npg = -(-ctx // PS)
        pt = np.zeros((B, W), np.int32)
        for b in range(B):
            pt[b, :npg] = rng.choice(P, npg, replace=False)
        pt, kv_lens = jnp.asarray(pt), jnp.full((B,), ctx, jnp.int32)
        ref = None
        for f in [int(x) for x in _NUM_FLAT.value] or [
            bucket_for(B * npg, pow2_buckets(B * W, start=8))
        ]:
            for name, impl in impls.items():
                args = (impl, q, kp, vp, kv_lens, pt, f)
                out = np.asarray(jax.block_until_ready(run(*args)), np.float32)  # compile
                ref = out if ref is None else ref
                ts = []
                for _ in range(_REPS.value):
                    t = time.perf_counter()
                    jax.block_until_ready(run(*args))
                    ts.append(time.perf_counter() - t)
                diff = float(np.abs(out - ref).max())
                print(
                    f"ctx {ctx:4d}  live pages {B * npg:5d}  F {f:5d}  {name:8s} "
                    f"{1e3 * np.median(ts):7.1f} ms   max |diff| vs first {diff:.2e}",
                    flush=True,
                )


if __name__ == "__main__":
    app.run(main)
