r"""SmolLM2's layer matmuls under `lax.scan`, separate vs joined q/k/v and gate/up (RESULTS 20c).

30 layers of bf16 weights stacked [L, K, N] and sliced by the scan, as in the model: per layer
q, k, v, o, gate, up, down as seven matmuls ('separate'), or q/k/v as one [576, 960] and gate/up
as one [576, 3072] matmul ('joined', what vLLM's QKV and merged gate-up layers do). Only the
matmuls and the elementwise glue: no attention, norms or KV cache. Median of --reps calls.

    .venv/bin/python experiments/cpu_joined_matmuls.py --rows=1,8,32,64
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

_ROWS = flags.DEFINE_list("rows", ["1", "8", "32", "64"], "Token rows M per call.")
_REPS = flags.DEFINE_integer("reps", 9, "Timed calls per point (median).")

L, D, I, Q, KV = 30, 576, 1536, 576, 192  # SmolLM2-135M


def mm(x, w):
    return jnp.einsum("ni,io->no", x, w)


def norm(x):  # keeps the 30-layer toy stack finite, so the two variants can be compared
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-6)).astype(x.dtype)


def separate(x, p, mm=mm):  # mm: `experiments/cpu_weight_layout.py` passes [out, in] weights' dot
    x = norm(x)
    q, k, v = mm(x, p["wq"]), mm(x, p["wk"]), mm(x, p["wv"])
    x = x + mm((q + jnp.tile(k + v, (1, 3))).astype(x.dtype), p["wo"])
    h = jax.nn.silu(mm(x, p["w_gate"])) * mm(x, p["w_up"])
    return x + mm(h.astype(x.dtype), p["w_down"]), None


def joined(x, p):
    x = norm(x)
    q, k, v = jnp.split(mm(x, p["wqkv"]), [Q, Q + KV], axis=-1)
    x = x + mm((q + jnp.tile(k + v, (1, 3))).astype(x.dtype), p["wo"])
    gate, up = jnp.split(mm(x, p["w_gate_up"]), 2, axis=-1)
    return x + mm((jax.nn.silu(gate) * up).astype(x.dtype), p["w_down"]), None


def main(argv):
    del argv
    rng = np.random.default_rng(0)

    def w(*shape):
        return jnp.asarray(0.02 * rng.standard_normal(shape), jnp.bfloat16)

    sep = dict(
        wq=w(L, D, Q), wk=w(L, D, KV), wv=w(L, D, KV), wo=w(L, Q, D),
        w_gate=w(L, D, I), w_up=w(L, D, I), w_down=w(L, I, D),
    )  # fmt: skip
    join = dict(
        wqkv=jnp.concatenate([sep["wq"], sep["wk"], sep["wv"]], -1),
        wo=sep["wo"],
        w_gate_up=jnp.concatenate([sep["w_gate"], sep["w_up"]], -1),
        w_down=sep["w_down"],
    )
    cases = {"separate": (separate, sep), "joined": (joined, join)}
    run = jax.jit(lambda body, x, p: jax.lax.scan(body, x, p)[0], static_argnums=0)
    for m in map(int, _ROWS.value):
        x = jnp.asarray(rng.standard_normal((m, D)), jnp.bfloat16)
        outs, times = {}, {}
        for name, (body, params) in cases.items():
            outs[name] = np.asarray(jax.block_until_ready(run(body, x, params)), np.float32)
            ts = []
            for _ in range(_REPS.value):
                t = time.perf_counter()
                jax.block_until_ready(run(body, x, params))
                ts.append(time.perf_counter() - t)
            times[name] = float(np.median(ts))
        rel = np.abs(outs["joined"] - outs["separate"]).max() / np.abs(outs["separate"]).max()
        print(
            f"M {m:4d}  separate {1e3 * times['separate']:6.1f} ms  joined "
            f"{1e3 * times['joined']:6.1f} ms  separate/joined "
            f"{times['separate'] / times['joined']:.2f}  max rel diff {rel:.1e}",
            flush=True,
        )


if __name__ == "__main__":
    app.run(main)
