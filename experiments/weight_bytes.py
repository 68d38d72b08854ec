"""Weight bytes of quantized models against bf16, from shapes only (no weights are allocated).

    python experiments/weight_bytes.py [--models smollm2-135m,llama3-8b] [--out FILE]

Runs the real `quantize_params` under `jax.eval_shape` on abstract bf16 params of each preset, so
the byte counts are exactly those of the arrays the quantizers would produce (packed codes,
float16 scales and mins, int8/fp8 values, f32 per-channel scales). The embedding table is quantized
too (`quantize_embedding=True`, its [D, V] lm_head view; for a tied model it is also the output
head); norms stay bf16. Prints a table (whole model; whole model with the embedding kept bf16,
`quantize_embedding=False`; the quantized linear weights alone) and writes JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.models import llama
from jaxserve.quant import linear_weight_names, quantize_params

RECIPES = [
    ("int4-rtn", 128),
    ("int4-rtn", 64),
    ("int4-rtn", 32),
    ("int4-rtn-asym", 128),
    ("int8", 128),
    ("fp8", 128),
]


def nbytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _get(params, name):
    for part in name.split("/"):
        params = params[part]
    return params


def measure(preset: str) -> list[dict]:
    config = ModelConfig.preset(preset)
    abstract = jax.eval_shape(
        functools.partial(llama.init_params, config, dtype=jnp.bfloat16), jax.random.key(0)
    )
    names = linear_weight_names(abstract, config)
    bf16_total = nbytes(abstract)
    bf16_linear = sum(nbytes(_get(abstract, n)) for n in names)
    rows = []
    for method, g in RECIPES:
        row = {"model": preset, "method": method, "group_size": g if "int4" in method else None}
        try:
            fn = functools.partial(quantize_params, config=config, method=method, group_size=g)
            q = jax.eval_shape(fn, abstract)
            q_float_embed = jax.eval_shape(
                functools.partial(fn, quantize_embedding=False), abstract
            )
        except ValueError as e:  # e.g. SmolLM2's 576 inputs are not a multiple of 128
            rows.append({**row, "error": str(e)})
            continue
        total, linear = nbytes(q), sum(nbytes(_get(q, n)) for n in names)
        rows.append(
            {
                **row,
                "bytes": total,
                "bf16_bytes": bf16_total,
                "ratio": total / bf16_total,
                "embed_bytes": nbytes(q["embed"]),
                "bf16_embed_bytes": nbytes(abstract["embed"]),
                "float_embed_bytes": nbytes(q_float_embed),
                "float_embed_ratio": nbytes(q_float_embed) / bf16_total,
                "linear_bytes": linear,
                "bf16_linear_bytes": bf16_linear,
                "linear_ratio": linear / bf16_linear,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2-135m,llama3-8b")
    parser.add_argument("--out", default="experiments/out/weight_bytes.json")
    opts = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    rows = [r for m in opts.models.split(",") for r in measure(m)]
    print(
        f"{'model':<14} {'method':<14} {'g':>4} {'MB':>9} {'bf16 MB':>9} {'x bf16':>7} "
        f"{'embed MB':>9} {'x (bf16 embed)':>14} {'linear x':>8}"
    )
    for r in rows:
        g = r["group_size"] or "-"
        if "error" in r:
            print(f"{r['model']:<14} {r['method']:<14} {g:>4}  n/a: {r['error']}")
            continue
        print(
            f"{r['model']:<14} {r['method']:<14} {g:>4} {r['bytes'] / 1e6:9.1f} "
            f"{r['bf16_bytes'] / 1e6:9.1f} {r['ratio']:7.3f} {r['embed_bytes'] / 1e6:9.1f} "
            f"{r['float_embed_ratio']:14.3f} {r['linear_ratio']:8.3f}"
        )
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
