"""Quantized weights on a 4-device CPU mesh: run by `test_tensor_parallel.py` in a subprocess.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/quant/tp_worker.py

Prints one JSON object: case name -> {"err": relative max error against one device (or null),
"bytes": [per-device bytes, total / T] (or null), "error": an exception's text (or null)}.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

assert "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""), "set XLA_FLAGS"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402

from jaxserve.quant import int4  # noqa: E402
from jaxserve.quant.int8 import Int8Weight, quantize_fp8, quantize_int8  # noqa: E402

K, N, G, L = 256, 64, 32, 3  # row split over 4: K/T = 64 (two groups); column: N/T = 16


def int4_weight(rng, lead=(), k=K, n=N, g=G, impl="xla"):
    codes = rng.integers(0, 16, size=(*lead, k, n))
    scales = rng.uniform(0.01, 0.1, size=(*lead, k // g, n))
    mins = rng.uniform(-1.0, 0.0, size=(*lead, k // g, n))
    return int4.pack(codes, scales, mins, g, impl=impl)


def make_weight(kind: str, rng, lead=()):
    if kind.startswith("int4"):
        return int4_weight(rng, lead, impl=kind.split("-")[1])
    w = rng.normal(size=(*lead, K, N)).astype(np.float32)
    if kind == "int8-g32":  # grouped scales: the row split cuts the group axis too
        q = np.clip(np.round(w * 20), -127, 127).astype(np.int8)
        scales = rng.uniform(0.01, 0.1, size=(*lead, K // G, N)).astype(np.float32)
        return Int8Weight(jnp.asarray(q), jnp.asarray(scales), group_size=G)
    return quantize_int8(w) if kind == "int8" else quantize_fp8(w)


def for_role(w, role: str, t: int):
    if isinstance(w, int4.Int4Weight) and role == "column":
        w = int4.repack(w, t)
    return w.replace(parallel=role)


def place(w, role: str, mesh):
    specs = w.partition_specs(role)
    return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), w, specs)


def per_device_bytes(w) -> int:
    return sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(w))


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def mesh_of(t: int, data: int = 1, axis_type=AxisType.Explicit):
    devs = np.array(jax.devices()[: data * t]).reshape(data, t)
    return jax.sharding.Mesh(devs, ("data", "model"), axis_types=(axis_type, axis_type))


def matmul_case(kind, role, t, stacked=False, data=1, axis_type=AxisType.Explicit):
    rng = np.random.default_rng(hash((kind, role, t, stacked)) % 2**32)
    w = make_weight(kind, rng, (L,) if stacked else ())
    x = jnp.asarray(rng.normal(size=(2 * data, 3, K)), jnp.float32)
    if stacked:
        one = w.matmul(x, layer=1) if kind.startswith("int4") else _layer(w, 1).matmul(x)
    else:
        one = w.matmul(x)
    mesh = mesh_of(t, data, axis_type)
    with jax.set_mesh(mesh):
        placed = place(for_role(w, role, t), role, mesh)
        if data > 1:
            x = jax.device_put(x, NamedSharding(mesh, jax.P("data")))
        if stacked:
            got = jax.jit(lambda w, x, layer: w.matmul(x, layer=layer))(placed, x, jnp.int32(1))
        else:
            got = jax.jit(lambda w, x: w.matmul(x))(placed, x)
    return {"err": rel_err(got, one), "bytes": [per_device_bytes(placed), split_bytes(w, role, t)]}


def split_bytes(w, role: str, t: int) -> float:
    """total / T, except that a per-channel 8-bit row shard keeps all its scales [1, N]."""
    if role == "row" and not isinstance(w, int4.Int4Weight) and w.scales.shape[-2] == 1:
        return w.q.nbytes / t + w.scales.nbytes
    return w.nbytes / t


def _layer(w, i):
    return jax.tree.map(lambda a: a[i], w)


def take_case(kind, role, t):
    rng = np.random.default_rng(7)
    table = make_weight(kind, rng)  # [D=K, V=N]: the lm_head view of an embedding
    ids = jnp.asarray([[0, 5, N - 1, -3, N + 9], [17, 17, 31, 32, 48]], jnp.int32)
    one = table.take(ids)
    mesh = mesh_of(t)
    with jax.set_mesh(mesh):
        placed = place(for_role(table, role, t), role, mesh)
        got = jax.jit(lambda w, ids: w.take(ids))(placed, ids)
    return {
        "err": rel_err(got, one),
        "bytes": [per_device_bytes(placed), split_bytes(table, role, t)],
    }


def scan_case(kind: str, role: str, t: int):
    """A square stack [L, D, D] used as the model's lax.scan does: INT4 whole with layer=i (read
    in place), INT8 sliced by the scan."""
    d = 128
    rng = np.random.default_rng(11)
    if kind.startswith("int4"):
        w = int4_weight(rng, (L,), k=d, n=d, impl=kind.split("-")[1])
    else:
        w = quantize_int8(rng.normal(size=(L, d, d)).astype(np.float32) / 8)
    h0 = jnp.asarray(rng.normal(size=(4, d)), jnp.float32)

    def run(w, h):
        if isinstance(w, int4.Int4Weight):
            step = lambda h, i: (jnp.tanh(w.matmul(h, layer=i)), None)
            return jax.lax.scan(step, h, jnp.arange(L))[0]
        return jax.lax.scan(lambda h, wl: (jnp.tanh(wl.matmul(h)), None), h, w)[0]

    one = jax.jit(run)(w, h0)
    mesh = mesh_of(t)
    with jax.set_mesh(mesh):
        placed = place(for_role(w, role, t), role, mesh)
        got = jax.jit(run)(placed, h0)
    return {"err": rel_err(got, one), "bytes": [per_device_bytes(placed), split_bytes(w, role, t)]}


def error_case(what: str):
    rng = np.random.default_rng(3)
    mesh = mesh_of(2)
    if what == "shards_mismatch":
        w = int4_weight(rng).replace(parallel="column")  # shards=1 on T=2
    else:  # K=96 over T=2: 48 rows per device, not a multiple of g=32
        w = int4_weight(rng, k=96).replace(parallel="row")
    x = jnp.ones((2, w.shape[0]), jnp.float32)
    with jax.set_mesh(mesh):
        jax.jit(lambda w, x: w.matmul(x))(w, x)
    raise AssertionError("no error raised")


def cases():
    out = {}
    for t in (2, 4):
        for kind in ("int4-xla", "int4-pallas_interpret", "int8", "int8-g32", "fp8"):
            for role in ("column", "row"):
                out[f"matmul/{kind}/{role}/T{t}"] = lambda k=kind, r=role, t=t: matmul_case(k, r, t)
            for role in ("column", "row"):
                out[f"stacked/{kind}/{role}/T{t}"] = lambda k=kind, r=role, t=t: matmul_case(
                    k, r, t, stacked=True
                )
        for kind in ("int4-xla", "int8"):
            for role in ("column", "row"):
                out[f"take/{kind}/{role}/T{t}"] = lambda k=kind, r=role, t=t: take_case(k, r, t)
    for kind in ("int4-xla", "int4-pallas_interpret", "int8"):
        for role in ("column", "row"):
            out[f"scan/{kind}/{role}/T2"] = lambda k=kind, r=role: scan_case(k, r, 2)
            out[f"dp2xtp2/{kind}/{role}"] = lambda k=kind, r=role: matmul_case(k, r, 2, data=2)
            out[f"auto_axes/{kind}/{role}"] = lambda k=kind, r=role: matmul_case(
                k, r, 2, stacked=True, axis_type=AxisType.Auto
            )
    for what in ("shards_mismatch", "group_boundary"):
        out[f"error/{what}"] = lambda w=what: error_case(w)
    return out


def main() -> int:
    only = sys.argv[1:]
    results = {}
    for name, fn in cases().items():
        if only and not any(name.startswith(o) for o in only):
            continue
        try:
            results[name] = {"error": None, **fn()}
        except Exception as e:  # reported to the test, which decides
            results[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
