"""W4A16 on the GPU: the fused Pallas kernel against its reference, then timed against XLA.

    python experiments/gpu_int4.py [--out DIR] [--iters N]     # on the H200 (< 8 minutes)
    python experiments/gpu_int4.py --smoke                     # tiny shapes, interpret mode, CPU

1. Correctness: `int4_matmul(impl="pallas")` against `int4_matmul_reference` for M in
   {1, 8, 32, 128, 512} at K = N = 4096, and the ragged SmolLM2 shapes (576, 1536), bf16.
2. Timing at M in {1, 8, 32, 128, 512} for K = N = 4096 and the Llama-3-8B MLP shapes
   (4096 x 14336, 14336 x 4096), symmetric RTN g128 weights, bf16 activations:
     bf16        XLA dot with a bf16 weight (cuBLAS)
     pallas      the fused kernel (u32-packed codes, f16 scales/mins)
     xla-int4    XLA's native int4: an s4[K, N] weight, convert * scale fused into the dot
     xla-unpack  our CPU path (unpack u32 + dequantize + dot) for reference
   Each op runs `--iters` times inside one jitted fori_loop (the input is perturbed by the loop
   carry so nothing is hoisted), so the time excludes Python dispatch. Prints time per call and the
   achieved weight-bytes bandwidth (bytes of that method's weight / time), and the speedup of the
   kernel over bf16; targets: >= 2.5x for M <= 16, >= 1x at M = 512.
3. In a layer scan, as the model runs it: a stack of L = 32 weights (K = N = 4096, g128) under
   `lax.scan`, each layer's kernel given either the whole stack and the layer index (`in_place`,
   what `llama.forward_parts` does) or the scan's per-layer slice (`sliced`, XLA writes the slice
   out for the custom call unless its dynamic-slice fusion absorbs it). Same results asserted;
   time per layer and the ratio.

Results: DIR/gpu_int4.json (written after every row, so a timeout keeps what finished) and the
printed table. DIR defaults to $OUT, else experiments/out/gpu_int4.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.quant import int4, rtn
from pallas_kernels.int4_matmul import int4_matmul, int4_matmul_reference, int4_matmul_xla
from pallas_kernels.int4_plan import Int4MatmulConfig, plan

FULL = dict(
    check=[(m, 4096, 4096, 128) for m in (1, 8, 32, 128, 512)]
    + [(8, 4096, 4096, 32, jnp.float32), (64, 1536, 576, 64, jnp.float32)]
    + [(1, 576, 1536, 64), (8, 1536, 576, 32), (128, 576, 192, 64)],
    bench_shapes=[(4096, 4096), (4096, 14336), (14336, 4096)],
    bench_m=(1, 8, 32, 128, 512),
    group_size=128,
    impl="pallas",
    # Tile sweep at K = N = 4096 (data for the `plan` heuristic): (M, [Int4MatmulConfig args]).
    sweep=[
        (1, [(16, bc, s) for bc in (16, 32, 64) for s in (4, 8, 16, 32)]),
        (32, [(bm, bc, s) for bm in (16, 32) for bc in (16, 32) for s in (2, 8)]),
        (512, [(bm, bc, 1, w) for bm in (64, 128) for bc in (16, 32, 64) for w in (4, 8)]),
    ],
)
FULL["stack"] = dict(layers=32, k=4096, m=(1, 8, 32, 512))
SMOKE = dict(
    check=[(1, 256, 128, 64), (8, 576, 192, 32, jnp.float32)],
    bench_shapes=[(256, 128)],
    bench_m=(1, 8),
    group_size=64,
    impl="pallas_interpret",
    sweep=[(8, [(16, 16, 1), (16, 16, 2)])],
    stack=dict(layers=3, k=256, m=(8,)),
)


def make_weight(k: int, n: int, g: int, seed: int = 0, symmetric: bool = True) -> int4.Int4Weight:
    w = jax.random.normal(jax.random.key(seed), (k, n), jnp.float32) * 0.02
    return rtn.quantize_int4_rtn(w, g, symmetric=symmetric)


def check(cases, impl: str) -> list[dict]:
    rows = []
    for m, k, n, g, *dt in cases:
        dtype = dt[0] if dt else jnp.bfloat16
        w = make_weight(k, n, g, symmetric=False)  # general mins, not just -8 * scale
        x = jax.random.normal(jax.random.key(1), (m, k), dtype)
        got = int4_matmul(x, w.packed, w.scales, w.mins, group_size=g, impl=impl)
        ref = int4_matmul_reference(x, w.packed, w.scales, w.mins, g)
        got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
        err = float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-30))
        ok = bool(err < 2e-2)
        rows.append(
            dict(m=m, k=k, n=n, group_size=g, dtype=jnp.dtype(dtype).name, max_rel_err=err, ok=ok)
        )
        print(
            f"check M={m:<4} K={k:<6} N={n:<6} g={g:<4} {jnp.dtype(dtype).name:<8} "
            f"max|err|/max|ref| = {err:.2e}  {'ok' if ok else 'FAIL'}"
        )
    return rows


def _loop(op, iters: int):
    """jit(fn(x, *w)): runs op `iters` times; x is perturbed by the carry so no call is hoisted."""

    @jax.jit
    def run(x, *w):
        def body(_, carry):
            acc = carry
            y = op(x + (acc * 0).astype(x.dtype), *w)  # (M, N)
            return acc + y[0, 0].astype(jnp.float32)

        return jax.lax.fori_loop(0, iters, body, jnp.zeros((), jnp.float32))

    return run


def timed(op, args, iters: int, repeats: int = 3) -> float:
    """Seconds per call of op(*args): the best of `repeats` runs of an `iters`-long device loop."""
    run = _loop(op, iters)
    run(*args).block_until_ready()  # compile + warm up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        run(*args).block_until_ready()
        best = min(best, (time.perf_counter() - t0) / iters)
    return best


def bench(shapes, ms, g: int, impl: str, iters: int, write) -> list[dict]:
    rows = []
    for k, n in shapes:
        w = make_weight(k, n, g)
        w_bf16 = w.dequantize().astype(jnp.bfloat16)  # (K, N)
        codes, scales, _ = int4.unpack(w)
        w_s4 = (codes.astype(jnp.int8) - 8).astype(jnp.int4)  # (K, N): symmetric, min = -8 scale
        s_bf16 = scales.astype(jnp.bfloat16)  # (K/g, N)
        nbytes = {
            "bf16": k * n * 2,
            "pallas": w.nbytes,
            "xla-int4": k * n // 2 + s_bf16.size * 2,
            "xla-unpack": w.nbytes,
        }

        ops = {
            "bf16": (lambda x, wb: jnp.dot(x, wb), (w_bf16,)),
            "pallas": (
                functools.partial(_pallas, group_size=g, impl=impl),
                (w.packed, w.scales, w.mins),
            ),
            "xla-int4": (functools.partial(_native_int4, group_size=g), (w_s4, s_bf16)),
            "xla-unpack": (
                functools.partial(int4_matmul_xla, group_size=g),
                (w.packed, w.scales, w.mins),
            ),
        }
        for m in ms:
            x = jax.random.normal(jax.random.key(2), (m, k), jnp.bfloat16)
            row = dict(m=m, k=k, n=n, group_size=g, plan=list(vars(plan(m, k, n, g)).values()))
            for name, (op, wargs) in ops.items():
                secs = timed(op, (x, *wargs), iters)
                row[f"{name}_us"] = secs * 1e6
                row[f"{name}_GBps"] = nbytes[name] / secs / 1e9
            row["speedup_vs_bf16"] = row["bf16_us"] / row["pallas_us"]
            row["speedup_vs_xla_int4"] = row["xla-int4_us"] / row["pallas_us"]
            rows.append(row)
            write(rows)
            print(
                f"M={m:<4} K={k:<6} N={n:<6} "
                + "  ".join(
                    f"{name} {row[f'{name}_us']:8.1f}us {row[f'{name}_GBps']:7.0f}GB/s"
                    for name in ops
                )
                + f"  kernel/bf16 {row['speedup_vs_bf16']:.2f}x"
            )
    return rows


def sweep(cases, g: int, impl: str, iters: int, smoke: bool) -> list[dict]:
    """Times the kernel under explicit tile configs (K = N = 4096, or 256 x 128 in smoke mode)."""
    k, n = (256, 128) if smoke else (4096, 4096)
    w = make_weight(k, n, g)
    rows = []
    for m, cfgs in cases:
        x = jax.random.normal(jax.random.key(3), (m, k), jnp.bfloat16)
        ref = np.asarray(int4_matmul_reference(x, w.packed, w.scales, w.mins, g), np.float32)
        for args in cfgs:
            cfg = Int4MatmulConfig(*args)
            op = functools.partial(_pallas, group_size=g, impl=impl, config=cfg)
            try:
                got = np.asarray(op(x, w.packed, w.scales, w.mins), np.float32)
                err = float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-30))
                us = timed(op, (x, w.packed, w.scales, w.mins), iters) * 1e6
                row = dict(m=m, k=k, n=n, config=args, us=us, GBps=w.nbytes / us / 1e3, err=err)
            except Exception as e:  # noqa: BLE001 - a config that fails to compile is a data point
                row = dict(m=m, k=k, n=n, config=args, error=f"{type(e).__name__}: {e}"[:300])
            rows.append(row)
            print(
                f"sweep M={m:<4} {args}: "
                + (
                    f"{row['us']:8.1f}us {row['GBps']:6.0f}GB/s err {row['err']:.1e}"
                    if "us" in row
                    else row["error"]
                )
            )
    return rows


def _scan_layers(x, packed, scales, mins, group_size, impl, in_place):
    """x through every layer of a stack [L, K, K] under lax.scan (h <- h + 0.01 * h @ W_l)."""
    if in_place:

        def body(h, li):
            y = int4_matmul(h, packed, scales, mins, group_size=group_size, impl=impl, layer=li)
            return h + (0.01 * y).astype(h.dtype), None

        xs = jnp.arange(packed.shape[0], dtype=jnp.int32)
    else:

        def body(h, w):
            y = int4_matmul(h, *w, group_size=group_size, impl=impl)
            return h + (0.01 * y).astype(h.dtype), None

        xs = (packed, scales, mins)
    return jax.lax.scan(body, x, xs)[0]


def stack_bench(spec, g: int, impl: str, iters: int) -> list[dict]:
    """Section 3 of the module doc: the kernel reading a stack's layer in place vs a slice."""
    layers, k = spec["layers"], spec["k"]
    ws = [make_weight(k, k, g, seed=10 + i) for i in range(layers)]
    stack = [jnp.stack([getattr(w, f) for w in ws]) for f in ("packed", "scales", "mins")]
    del ws
    rows = []
    for m in spec["m"]:
        x = jax.random.normal(jax.random.key(4), (m, k), jnp.bfloat16)
        row = dict(m=m, layers=layers, k=k, n=k, group_size=g)
        outs = {}
        for name in ("in_place", "sliced"):
            op = functools.partial(
                _scan_layers, group_size=g, impl=impl, in_place=name == "in_place"
            )
            outs[name] = np.asarray(jax.jit(op)(x, *stack), np.float32)
            row[f"{name}_us_per_layer"] = timed(op, (x, *stack), max(1, iters // 4)) * 1e6 / layers
        row["same"] = bool(np.array_equal(outs["in_place"], outs["sliced"]))
        row["sliced_over_in_place"] = row["sliced_us_per_layer"] / row["in_place_us_per_layer"]
        rows.append(row)
        print(
            f"stack L={layers} M={m:<4} K=N={k}: in place {row['in_place_us_per_layer']:8.1f}us"
            f"/layer, sliced {row['sliced_us_per_layer']:8.1f}us/layer "
            f"(sliced/in place {row['sliced_over_in_place']:.2f}x), "
            f"{'same output' if row['same'] else 'OUTPUTS DIFFER'}"
        )
    return rows


def _native_int4(x, w_s4, s, group_size):
    """XLA's native int4: s4[K, N] -> x.dtype, times its group scale, then a dot (XLA fuses these)."""
    k, n = w_s4.shape
    wd = w_s4.astype(x.dtype).reshape(k // group_size, group_size, n) * s[:, None, :]
    return jnp.dot(x, wd.reshape(k, n), preferred_element_type=jnp.float32).astype(x.dtype)


def _pallas(x, packed, scales, mins, group_size, impl, config=None):
    return int4_matmul(x, packed, scales, mins, group_size=group_size, impl=impl, config=config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (CPU)")
    parser.add_argument("--out", default=os.environ.get("OUT") or "experiments/out/gpu_int4")
    parser.add_argument("--iters", type=int, default=None, help="calls per timed device loop")
    parser.add_argument("--no-sweep", action="store_true", help="skip the tile-config sweep")
    opts = parser.parse_args()
    spec = SMOKE if opts.smoke else FULL
    iters = opts.iters or (2 if opts.smoke else 100)
    if not opts.smoke and jax.default_backend() != "gpu":
        raise SystemExit("no GPU: run with --smoke for the CPU interpret-mode check")
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    result = dict(device=str(jax.devices()[0]), jax=jax.__version__, smoke=opts.smoke)

    def write(rows=None):
        if rows is not None:
            result["bench"] = rows
        (out / "gpu_int4.json").write_text(json.dumps(result, indent=1))

    t0 = time.perf_counter()
    result["check"] = check(spec["check"], spec["impl"])
    write()
    bench(spec["bench_shapes"], spec["bench_m"], spec["group_size"], spec["impl"], iters, write)
    result["stack"] = stack_bench(spec["stack"], spec["group_size"], spec["impl"], iters)
    write()
    if not opts.no_sweep:
        result["sweep"] = sweep(spec["sweep"], spec["group_size"], spec["impl"], iters, opts.smoke)
        write()
    result["seconds"] = time.perf_counter() - t0
    write()
    failed = [c for c in result["check"] if not c["ok"]]
    failed += [r for r in result["stack"] if not r["same"]]
    print(
        f"done in {result['seconds']:.0f} s; {len(failed)} check(s) failed; wrote {out / 'gpu_int4.json'}"
    )
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
