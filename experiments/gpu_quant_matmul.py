"""Quantized-weight matmuls on the GPU: the Mosaic GPU kernels beside the Triton kernels and the
bf16 dot (issue 55).

    python experiments/gpu_quant_matmul.py [--out DIR] [--iters N] [--budget_s S]  # H100 / H200
    python experiments/gpu_quant_matmul.py --smoke                 # interpret mode, small, CPU

For INT4 (RTN, g = 128, the packed layout), INT8 and FP8 (e4m3, per-column scales) weights,
Llama-3-8B projection shapes (4096 x 4096, 4096 x 14336, 14336 x 4096) and decode batches M in
{1, 8, 16, 32, 64}, each as the engine runs it, one layer of a 32-layer stack read in place at a
traced index:

    mosaic   `pallas_kernels/mgpu_w4_matmul.py` / `mgpu_w8_matmul.py` (TMA + wgmma)
    triton   `pallas_kernels/int4_matmul.py` / `w8_matmul.py`, the engine's kernels today
    xla      the engine's XLA path on the same stack (impl 'xla': the layer sliced out, then
             unpack / convert + dot), what it runs above a kernel's row limit
    bf16     XLA's dot with a bf16 weight of the same shape (one layer, no stack): what the
             quantized kernels must beat (issue 55's targets at 1-16 rows: INT4 >= 2.5x, INT8
             and FP8 >= 1.7x)
    xla_int4 (INT4 rows only) XLA itself: `pallas_kernels/xla_int4_matmul.py`, a jnp.int4
             weight (the same RTN codes as the kernels' last layer, minus 8) with bf16 group
             scales, `x @ (w.astype(bf16) * scale)`, one layer, no stack, compiled with
             `xla_gpu_experimental_enable_subchannel_dequantisation_fusion` (the dequantize fused
             into XLA's Triton GEMM: no bf16 weight written); `xla_int4_noflag` the same without
             the flag (XLA's default: a fusion writes the whole bf16 weight, then the GEMM).

Every row first checks each candidate against its f32 reference on its inputs (the kernels and
xla against the kernels' reference, xla_int4 against `xla_int4_matmul_reference`; `NAME_ok`).
Each op runs `--iters` times inside one jitted fori_loop (`jaxserve.bench.device_loop`: inputs
tied to the carry, output behind a barrier, so nothing is hoisted or narrowed), so a row's time
excludes dispatch; it prints us per call, weight GB/s and the speedups over bf16 and Triton.
Results: DIR/gpu_quant_matmul.json (rewritten after every row) and gpu_quant_matmul.md; DIR defaults to $OUT. A
wall-clock budget skips the rows it cannot reach, marked as skipped. `python -m
jaxserve.bench.kernel_choices DIR` turns the JSON into the GPU kernel table's proposed rows.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.bench.device_loop import seconds_per_call
from jaxserve.quant.int8 import quantize_fp8, quantize_int8
from jaxserve.quant.rtn import quantize_int4_rtn, quantize_rtn
from pallas_kernels.int4_layout import dequantize_arrays
from pallas_kernels.int4_matmul import int4_matmul, int4_matmul_reference
from pallas_kernels.mgpu_w4_matmul import int4_matmul_mgpu
from pallas_kernels.mgpu_w8_matmul import w8_matmul_mgpu
from pallas_kernels.w8_matmul import w8_matmul, w8_matmul_reference
from pallas_kernels.xla_int4_matmul import (
    SUBCHANNEL_FLAG,
    from_rtn,
    xla_int4_matmul,
    xla_int4_matmul_reference,
)

SHAPES = ((4096, 4096), (4096, 14336), (14336, 4096))
ROWS = (1, 8, 16, 32, 64)  # the GPU kernel table's buckets: 1-16, 17-32, 33-64
LAYERS = 32
KINDS = ("int4", "int8", "fp8")
GROUP = 128  # INT4's group size (RTN, symmetric)


def stack(kind: str, layers: int, k: int, n: int, seed: int = 0) -> tuple[tuple, tuple | None]:
    """A [layers, K, N] weight stack's arrays: int8 / e4m3 codes and per-column scales f32[L, 1,
    N], or INT4's packed u32[L, K, N/8], scales and mins f16[L, K/g, N]; and for INT4 the last
    layer as the XLA-native candidate's arrays (s4[K, N], bf16[K/g, N]: the same RTN codes)."""
    w = jax.random.normal(jax.random.key(seed), (layers, k, n), jnp.float32) * k**-0.5
    if kind == "int4":
        q = quantize_int4_rtn(w, GROUP)
        codes, scales, _ = quantize_rtn(w[-1], GROUP)  # symmetric, as quantize_int4_rtn
        return (q.packed, q.scales, q.mins), from_rtn(codes, scales)
    quantize = quantize_int8 if kind == "int8" else quantize_fp8
    return jax.vmap(lambda a: (lambda q: (q.q, q.scales))(quantize(a)))(w), None


def kernels(kind: str, interpret: bool) -> tuple:
    """(mosaic, triton, xla, reference) for `kind`: ops (x, *stack, layer), the reference
    (x, *one layer's)."""
    triton_impl = "pallas_interpret" if interpret else "pallas"
    if kind == "int4":
        return (
            lambda x, p, s, m, i: int4_matmul_mgpu(
                x, p, s, m, group_size=GROUP, layer=i, interpret=interpret
            ),
            lambda x, p, s, m, i: int4_matmul(
                x, p, s, m, group_size=GROUP, impl=triton_impl, layer=i
            ),
            lambda x, p, s, m, i: int4_matmul(x, p, s, m, group_size=GROUP, impl="xla", layer=i),
            lambda x, p, s, m: int4_matmul_reference(x, p, s, m, GROUP),
        )
    return (
        lambda x, q, s, i: w8_matmul_mgpu(x, q, s, i, interpret=interpret),
        lambda x, q, s, i: w8_matmul(x, q, s, impl=triton_impl, layer=i),
        lambda x, q, s, i: w8_matmul(x, q, s, impl="xla", layer=i),
        w8_matmul_reference,
    )


def dense(kind: str, one: tuple) -> jax.Array:
    """One layer's weight in bf16 (the dot the kernels race)."""
    if kind == "int4":
        return dequantize_arrays(*one, GROUP, 1).astype(jnp.bfloat16)
    return (one[0].astype(jnp.float32) * one[1]).astype(jnp.bfloat16)


def ratio(t: dict, a: str, b: str) -> float | None:
    """t[a] / t[b] (a speedup of b over a), None where either did not run."""
    return t[a] / t[b] if a in t and b in t else None


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-6))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "experiments/out/gpu_quant_matmul"))
    ap.add_argument("--smoke", action="store_true", help="small shapes, interpret mode (CPU)")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--budget_s", type=float, default=200.0)
    opts = ap.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not opts.smoke:
        ap.error("no GPU: run with --smoke (interpret mode, small shapes)")
    interpret = not on_gpu
    shapes, rows, layers, iters = SHAPES, ROWS, LAYERS, opts.iters
    if opts.smoke:
        shapes, rows, layers, iters = ((256, 128),), (8,), 3, 2
    deadline = time.monotonic() + opts.budget_s
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    res = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, smoke=opts.smoke, rows=[])
    res["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"device {res['device']}, jax {res['jax']}, interpret={interpret}")

    def write():
        (out / "gpu_quant_matmul.json").write_text(json.dumps(res, indent=1))

    layer = jnp.int32(layers - 1)
    flag = {"compiler_options": {SUBCHANNEL_FLAG: True}}  # XLA:CPU keeps it too, unused
    for kind in KINDS:
        mosaic, triton, xla_path, reference = kernels(kind, interpret)
        for k, n in shapes:
            w, w_xla = stack(kind, layers, k, n)
            one = tuple(a[-1] for a in w)
            w_bf16 = dense(kind, one)
            for m in rows:
                row = dict(kind=kind, m=m, k=k, n=n)
                res["rows"].append(row)
                if time.monotonic() > deadline:
                    row["skipped"] = "time budget"
                    continue
                x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
                want = np.asarray(reference(x, *one), np.float32)
                # name -> (op, its arguments, jit keywords): each checked, then timed
                cands = {
                    name: (op, (x, *w, layer), {})
                    for name, op in (("mosaic", mosaic), ("triton", triton), ("xla", xla_path))
                }
                if w_xla is not None:  # checked with the flag it is timed with
                    cands["xla_int4"] = (xla_int4_matmul, (x, *w_xla), flag)
                for name, (op, args, kw) in cands.items():
                    ref = want if name != "xla_int4" else xla_int4_matmul_reference(x, *w_xla)
                    try:  # a candidate that fails to compile or run is its own result
                        row[f"{name}_rel_err"] = rel_err(jax.jit(op, **kw)(*args), ref)
                    except Exception as e:  # noqa: BLE001
                        row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:500]}"
                        print(f"  {kind} M={m} {k}x{n}: {name} failed: {row[f'{name}_error']}")
                errs = {key[: -len("_rel_err")]: v for key, v in row.items() if "_rel_err" in key}
                row.update({f"{name}_ok": errs.get(name, 1.0) < 2e-2 for name in cands})
                row["ok"] = all(row[f"{name}_ok"] for name in cands)
                row["weight_bytes"] = sum(a[-1].nbytes for a in w)  # one layer, as a call reads
                timed = {name: c for name, c in cands.items() if name in errs}
                timed["bf16"] = (lambda x, w: x @ w, (x, w_bf16), {})
                if "xla_int4" in timed:
                    timed["xla_int4_noflag"] = (xla_int4_matmul, (x, *w_xla), {})
                t = {}
                for name, (op, args, kw) in timed.items():
                    try:
                        t[name] = seconds_per_call(op, args, iters, **kw)
                    except Exception as e:  # noqa: BLE001 - as above: this candidate's result
                        row[f"{name}_error"] = f"timing: {type(e).__name__}: {str(e)[:500]}"
                        row[f"{name}_ok"] = row["ok"] = False
                        print(f"  {kind} M={m} {k}x{n}: {name} failed: {row[f'{name}_error']}")
                row.update({f"{name}_us": s * 1e6 for name, s in t.items()})
                if "mosaic" in t:
                    row["mosaic_gbs"] = row["weight_bytes"] / t["mosaic"] / 1e9
                row["mosaic_vs_bf16"] = ratio(t, "bf16", "mosaic")
                row["mosaic_vs_triton"] = ratio(t, "triton", "mosaic")
                row["triton_vs_bf16"] = ratio(t, "bf16", "triton")
                if "xla_int4" in t:
                    row["xla_int4_gbs"] = sum(a.nbytes for a in w_xla) / t["xla_int4"] / 1e9
                    row["xla_int4_vs_bf16"] = ratio(t, "bf16", "xla_int4")
                    row["mosaic_vs_xla_int4"] = ratio(t, "xla_int4", "mosaic")
                times = "  ".join(f"{name} {s * 1e6:8.1f} us" for name, s in t.items())
                print(f"  {kind} M={m:3d} {k}x{n}: {times}  (ok {row['ok']})")
                write()
    lines = [
        f"# Quantized-weight matmuls on {res['device']} (jax {res['jax']}{', smoke' if opts.smoke else ''})",
        "",
        "| weight | M | K x N | mosaic us | triton us | xla us | bf16 us | xla int4 us "
        "| xla int4 no-flag us | mosaic x bf16 | mosaic x triton | triton x bf16 "
        "| mosaic x xla int4 | mosaic GB/s | ok |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(r, key, fmt):  # a failed candidate's cells: "failed"; a missing one's: empty
        if r.get(key) is not None:
            return format(r[key], fmt)
        return "failed" if key.endswith("_us") and f"{key[:-3]}_error" in r else ""

    for r in res["rows"]:
        if "skipped" in r:
            lines.append(f"| {r['kind']} | {r['m']} | {r['k']}x{r['n']} | skipped |||||||||||")
            continue
        cells = [
            cell(r, key, fmt)
            for key, fmt in (
                ("mosaic_us", ".1f"),
                ("triton_us", ".1f"),
                ("xla_us", ".1f"),
                ("bf16_us", ".1f"),
                ("xla_int4_us", ".1f"),
                ("xla_int4_noflag_us", ".1f"),
                ("mosaic_vs_bf16", ".2f"),
                ("mosaic_vs_triton", ".2f"),
                ("triton_vs_bf16", ".2f"),
                ("mosaic_vs_xla_int4", ".2f"),
                ("mosaic_gbs", ".0f"),
            )
        ]
        lines.append(
            f"| {r['kind']} | {r['m']} | {r['k']}x{r['n']} | "
            + " | ".join(cells)
            + f" | {'yes' if r['ok'] else 'NO'} |"
        )
    (out / "gpu_quant_matmul.md").write_text("\n".join(lines) + "\n")
    write()
    print("\n".join(lines))
    return 0 if all(r.get("ok", True) for r in res["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
