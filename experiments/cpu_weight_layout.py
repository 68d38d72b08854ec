r"""SmolLM2's layer matmuls under `lax.scan`, weights stored [L, in, out] vs [L, out, in] (RESULTS 21).

The model's params store every linear weight as [in, out], multiplied as `x @ w` ('ni,io->no'). This
script times the same 30-layer stack of bf16 q, k, v, o, gate, up, down weights stored transposed,
[out, in], multiplied as 'ni,oi->no' (how the tied logits read the [V, D] embedding, and how
PyTorch's nn.Linear stores weights). Since the eleventh session `ModelRunner` stores plain layer
weights the second way on CPU (`jaxserve.layers.linear.TransposedWeight`). Same values in both layouts; the two variants are called
in turn, --reps times each, and the script checks they give the same output. Only the matmuls and
the elementwise glue: no attention, norms or KV cache. Median of --reps calls.

    .venv/bin/python experiments/cpu_weight_layout.py --rows=4,8,32,64,128
    .venv/bin/python experiments/cpu_weight_layout.py --rows=4,32,64 --f32   # + f32-stored weights

The layer is `experiments/cpu_joined_matmuls.py`'s `separate`, and --rows / --reps are its flags.
"""

from __future__ import annotations

import functools
import json
import time

import cpu_joined_matmuls as cjm  # same directory: its `separate` layer and --rows / --reps flags
import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

_JSON = flags.DEFINE_string("json", None, "Write the timings here.")
_F32 = flags.DEFINE_bool(
    "f32", False, "Also time [L, out, in] weights upcast once to f32 (x cast to f32 per dot)."
)


def mm_transposed(x, w):
    return jnp.einsum("ni,oi->no", x, w)


def mm_transposed_f32(x, w):  # w: f32 holding the bf16 values; the product is rounded to bf16
    return jnp.einsum("ni,oi->no", x.astype(jnp.float32), w).astype(x.dtype)


def main(argv):
    del argv
    rng = np.random.default_rng(0)
    L, D, I, Q, KV = cjm.L, cjm.D, cjm.I, cjm.Q, cjm.KV  # SmolLM2-135M
    shapes = dict(
        wq=(D, Q), wk=(D, KV), wv=(D, KV), wo=(Q, D), w_gate=(D, I), w_up=(D, I), w_down=(I, D)
    )
    in_out = {
        n: jnp.asarray(0.02 * rng.standard_normal((L, *s)), jnp.bfloat16) for n, s in shapes.items()
    }
    out_in = {n: jnp.swapaxes(w, 1, 2).copy() for n, w in in_out.items()}
    cases = {
        "[L, in, out]": (cjm.separate, in_out),
        "[L, out, in]": (functools.partial(cjm.separate, mm=mm_transposed), out_in),
    }
    if _F32.value:
        out_in_f32 = {n: w.astype(jnp.float32) for n, w in out_in.items()}
        cases["[L, out, in] f32"] = (
            functools.partial(cjm.separate, mm=mm_transposed_f32),
            out_in_f32,
        )
    run = jax.jit(lambda body, x, p: jax.lax.scan(body, x, p)[0], static_argnums=0)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {L} layers, bf16")
    extra = " | [L, out, in] f32 ms" if _F32.value else ""
    print(f"| rows | [L, in, out] ms | [L, out, in] ms | in,out / out,in{extra} |")
    print("|---:|---:|---:|---:" + ("|---:" if _F32.value else "") + "|")
    results = []
    for m in map(int, cjm._ROWS.value):
        x = jnp.asarray(rng.standard_normal((m, D)), jnp.bfloat16)
        outs = {n: np.asarray(run(body, x, p), np.float32) for n, (body, p) in cases.items()}
        a, b, *f32 = outs.values()
        np.testing.assert_allclose(a, b, rtol=0.05, atol=0.05)  # same values, other summation order
        for c in f32:  # rounded once per dot instead of in bf16 dots: 30 toy layers drift further
            assert np.abs(c - a).max() <= 0.1 * np.abs(a).max(), np.abs(c - a).max()
        times = {n: [] for n in cases}
        for _ in range(cjm._REPS.value):  # alternate, so drift on this noisy VM hits both
            for n, (body, p) in cases.items():
                t = time.perf_counter()
                jax.block_until_ready(run(body, x, p))
                times[n].append(time.perf_counter() - t)
        med = {n: float(np.median(ts)) * 1e3 for n, ts in times.items()}
        ta, tb, *tf = med.values()
        f32 = f" | {tf[0]:.1f}" if tf else ""
        print(f"| {m} | {ta:.1f} | {tb:.1f} | {ta / tb:.2f}x{f32} |", flush=True)
        results.append({"rows": m, "median_ms": med, "ratio": ta / tb})
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump({"jax": jax.__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    app.run(main)
