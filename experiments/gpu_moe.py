"""A mixture of experts' layer on the GPU: quantized experts through the tiled kernels, against the
path they replaced and against bf16 experts (issue 54; JOURNAL.md 63a).

    python experiments/gpu_moe.py [--out DIR] [--iters N] [--budget_s S]   # H100 / H200
    python experiments/gpu_moe.py --smoke                                 # interpret mode, CPU

`layers/moe.moe_mlp` at Mixtral-8x7B's (D 4096, I 14336, 8 experts, top 2) and Qwen3-30B-A3B's
(D 2048, I 768, 128 experts, top 8) layer shapes, N tokens in {1, 8, 64} (decode at that many
slots) and 512 (a prefill step), INT4 (RTN, g 128) and FP8 experts, each stack [2 layers, E, K,
N] read at layer 1 as the engine's layer scan reads it (`StackedExperts`):

    kernel      grouped='kernel': one tiled INT4 / W8A16 kernel launch per weight over every
                tile, each reading its expert in place (the engine's GPU path since 63a), where
                `moe_tiles.kernel_tile` takes it (the row's `tile`), else ragged_dot
    kernel_any  the same with `moe_tiles.MAX_TILES_PER_EXPERT` lifted while tracing: the kernel
                path at every N, to set that cutoff (it is a byte count, not yet a timing)
    ragged      grouped='ragged_dot' on the same quantized stacks: the layer's experts
                dequantized to bf16 inside the step, then XLA's ragged_dot (the path before 63a)
    bf16        grouped='ragged_dot' on bf16 experts of the same shapes (a float model's path)

Each is checked first against `moe_mlp_reference` on the dequantized f32 weights (`NAME_ok`), then
timed with `jaxserve.bench.device_loop` (iters calls in one program), each under the engine's XLA
options for its weights (`gpu_choices.gpu_compiler_options`). Results: DIR/gpu_moe.json (rewritten
after every row) and gpu_moe.md; DIR defaults to $OUT. Rows the wall-clock budget cannot reach
are marked skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.bench.device_loop import seconds_per_call
from jaxserve.config.gpu_choices import gpu_compiler_options
from jaxserve.layers import moe, moe_tiles
from jaxserve.quant import with_matmul_impl
from jaxserve.quant.int8 import quantize_fp8
from jaxserve.quant.rtn import quantize_int4_rtn

# name -> (D, I, experts, top k)
MODELS = {"mixtral-8x7b": (4096, 14336, 8, 2), "qwen3-30b-a3b": (2048, 768, 128, 8)}
TOKENS = (1, 8, 64, 512)
FORMATS = {"int4": lambda w: quantize_int4_rtn(w, 128), "fp8": quantize_fp8}
LAYERS = 2


def experts(d: int, i: int, e: int, fmt: str, interpret: bool, seed: int = 0):
    """(quantized stacks [LAYERS, E, ...] with the kernel impl, their dequantized layer 1 in f32)
    for w_gate, w_up [E, D, I] and w_down [E, I, D]."""
    shapes = ((LAYERS, e, d, i), (LAYERS, e, d, i), (LAYERS, e, i, d))
    keys = jax.random.split(jax.random.key(seed), 3)
    floats = [jax.random.normal(k, s, jnp.bfloat16) * s[2] ** -0.5 for k, s in zip(keys, shapes)]
    quantized = with_matmul_impl(
        [FORMATS[fmt](w.astype(jnp.float32)) for w in floats],
        "pallas_interpret" if interpret else "pallas",
    )
    return quantized, [w.dequantize()[1] for w in quantized]


@contextlib.contextmanager
def tiles_unlimited(on: bool):
    """`moe_tiles.MAX_TILES_PER_EXPERT` lifted (on) while the kernel path is traced."""
    old = moe_tiles.MAX_TILES_PER_EXPERT
    moe_tiles.MAX_TILES_PER_EXPERT = 1 << 30 if on else old
    try:
        yield
    finally:
        moe_tiles.MAX_TILES_PER_EXPERT = old


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-6))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "experiments/out/gpu_moe"))
    ap.add_argument("--smoke", action="store_true", help="small shapes, interpret mode (CPU)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--budget_s", type=float, default=150.0)
    opts = ap.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not opts.smoke:
        ap.error("no GPU: run with --smoke (interpret mode, small shapes)")
    models, tokens, iters = MODELS, TOKENS, opts.iters
    if opts.smoke:
        models, tokens, iters = {"smoke": (128, 128, 4, 2)}, (8, 128), 2  # 128: past the cutoff
    deadline = time.monotonic() + opts.budget_s
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    res = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, smoke=opts.smoke, rows=[])
    res["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"device {res['device']}, jax {res['jax']}, interpret={not on_gpu}")
    options = {
        plain: {"compiler_options": dict(gpu_compiler_options(plain))} if on_gpu else {}
        for plain in (True, False)
    }
    for model, (d, i, e, k) in models.items():
        for fmt in FORMATS:
            quantized, layer = experts(d, i, e, fmt, not on_gpu)
            stacked = [moe.StackedExperts(w, jnp.int32(1)) for w in quantized]
            bf16 = [w.astype(jnp.bfloat16) for w in layer]
            for n in tokens:
                row = dict(model=model, fmt=fmt, tokens=n)
                res["rows"].append(row)
                if time.monotonic() > deadline:
                    row["skipped"] = "time budget"
                    continue
                x = jax.random.normal(jax.random.key(n), (n, d), jnp.bfloat16)
                logits = jax.random.normal(jax.random.key(n + 1), (n, e), jnp.bfloat16)
                want = moe.moe_mlp_reference(
                    x.astype(jnp.float32), logits.astype(jnp.float32), *layer, k, True
                )
                row["tile"] = moe_tiles.kernel_tile(stacked, n * k, e)  # None: ragged_dot
                cands = {  # name -> (op, weights, jit keywords)
                    "kernel": ("kernel", stacked, options[False]),
                    "kernel_any": ("kernel", stacked, options[False]),
                    "ragged": ("ragged_dot", stacked, options[False]),
                    "bf16": ("ragged_dot", bf16, options[True]),
                }
                t = {}
                for name, (grouped, ws, kw) in cands.items():

                    def op(x, logits, ws, grouped=grouped, k=k):
                        return moe.moe_mlp(x, logits, *ws, k, True, grouped)

                    try:  # a candidate that fails is its own result
                        with tiles_unlimited(name == "kernel_any"):  # traced inside
                            got = jax.jit(op, **kw)(x, logits, ws)
                            t[name] = seconds_per_call(op, (x, logits, ws), iters, **kw)
                        row[f"{name}_rel_err"] = rel_err(got, want)
                        row[f"{name}_ok"] = row[f"{name}_rel_err"] < 3e-2
                    except Exception as exc:  # noqa: BLE001
                        row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
                        row[f"{name}_ok"] = False
                        print(f"  {model} {fmt} N={n}: {name} failed: {row[f'{name}_error']}")
                row.update({f"{name}_us": s * 1e6 for name, s in t.items()})
                if "kernel" in t and "ragged" in t:
                    row["kernel_vs_ragged"] = t["ragged"] / t["kernel"]
                if "kernel_any" in t and "ragged" in t:
                    row["kernel_any_vs_ragged"] = t["ragged"] / t["kernel_any"]
                if "kernel" in t and "bf16" in t:
                    row["kernel_vs_bf16"] = t["bf16"] / t["kernel"]
                row["ok"] = all(row[f"{name}_ok"] for name in cands)
                times = "  ".join(f"{name} {s * 1e6:9.1f} us" for name, s in t.items())
                print(f"  {model} {fmt} N={n:3d}: {times}  (ok {row['ok']})")
                (out / "gpu_moe.json").write_text(json.dumps(res, indent=1))
    lines = [
        f"# MoE layer on {res['device']} (jax {res['jax']}{', smoke' if opts.smoke else ''})",
        "",
        "| model | experts | N | tile | kernel us | kernel_any us | ragged us | bf16 us "
        "| kernel x ragged | kernel_any x ragged | kernel x bf16 | ok |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        if "skipped" in r:
            lines.append(f"| {r['model']} | {r['fmt']} | {r['tokens']} | skipped |||||||||")
            continue
        cells = [
            format(r[key], fmt) if r.get(key) is not None else ""
            for key, fmt in (
                ("kernel_us", ".1f"),
                ("kernel_any_us", ".1f"),
                ("ragged_us", ".1f"),
                ("bf16_us", ".1f"),
                ("kernel_vs_ragged", ".2f"),
                ("kernel_any_vs_ragged", ".2f"),
                ("kernel_vs_bf16", ".2f"),
            )
        ]
        cells.insert(0, str(r["tile"] or "ragged"))
        ok = "yes" if r["ok"] else "NO"
        lines.append(
            f"| {r['model']} | {r['fmt']} | {r['tokens']} | " + " | ".join(cells) + f" | {ok} |"
        )
    (out / "gpu_moe.md").write_text("\n".join(lines) + "\n")
    (out / "gpu_moe.json").write_text(json.dumps(res, indent=1))
    print("\n".join(lines))
    return 0 if all(r.get("ok", True) for r in res["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
