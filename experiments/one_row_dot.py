r"""Time SmolLM2's tied-logits dot at few rows: plain einsum vs `jaxserve.layers.linear.matmul`.

hidden bf16[M, 576] @ embed bf16[49152, 576]^T -> f32[M, 49152], the dot every prefill step (one
row per chunk) and every decode step (one row per slot) ends with. XLA's CPU backend converts the
whole table to f32 for a one-row bf16 dot; `matmul` pads fewer than 4 rows up to 4 on CPU.
Median of --reps calls per point; prints a markdown table and writes --json if given.

    .venv/bin/python experiments/one_row_dot.py [--rows 1,2,4,8] [--reps 20] [--json PATH]
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
from absl import app, flags

from jaxserve.bench.core import median_ms
from jaxserve.layers.linear import matmul

_ROWS = flags.DEFINE_list("rows", ["1", "2", "4", "8"], "Row counts M to time.")
_REPS = flags.DEFINE_integer("reps", 20, "Timed calls per point (median).")
_JSON = flags.DEFINE_string("json", None, "Write the results here.")


def main(argv):
    del argv
    kx, kw = jax.random.split(jax.random.key(0))
    table = (0.02 * jax.random.normal(kw, (49152, 576))).astype(jnp.bfloat16)
    plain = jax.jit(lambda x, w: jnp.einsum("md,vd->mv", x, w, preferred_element_type=jnp.float32))
    padded = jax.jit(lambda x, w: matmul(x, w, transposed=True, out_dtype=jnp.float32))
    rows = []
    print("| rows | plain einsum ms | jaxserve matmul ms |\n|---:|---:|---:|")
    for m in map(int, _ROWS.value):
        x = jax.random.normal(kx, (m, 576)).astype(jnp.bfloat16)
        r = {
            "rows": m,
            "plain_ms": median_ms(plain, x, table, reps=_REPS.value),
            "matmul_ms": median_ms(padded, x, table, reps=_REPS.value),
        }
        rows.append(r)
        print(f"| {m} | {r['plain_ms']:.1f} | {r['matmul_ms']:.1f} |")
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump({"backend": jax.default_backend(), "results": rows}, f, indent=1)


if __name__ == "__main__":
    app.run(main)
