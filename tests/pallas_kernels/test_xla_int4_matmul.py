"""XLA-native INT4 weights (`pallas_kernels.xla_int4_matmul`): the form against its f32 reference
and the RTN grid on the CPU, and what XLA compiles it to for an H100 (deviceless).

Why the compiled program is asserted: the XLA-native candidate in experiments/gpu_quant_matmul.py
only races the INT4 kernels fairly if XLA reads the int4 weight in place. With XLA 0.11.2's
defaults it does not: a fusion writes the dequantized weight as bf16 (4x the int4 bytes) and the
GEMM reads it back, at decode and prefill sizes alike; with `SUBCHANNEL_FLAG` the dequantize is
inside the Triton GEMM's operand and nothing bf16 of the weight's size is written. If a jax upgrade
changes either, the GPU timings of that row mean something else, and this test says so first.
"""

from __future__ import annotations

import pytest

from jaxserve.bench import deviceless

deviceless.prepare()  # before jax starts its backends (the CUDA plugin needs no driver then)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxserve.bench.xla_text import array_shapes, attr, parse_module  # noqa: E402
from jaxserve.quant.rtn import quantize_rtn  # noqa: E402
from pallas_kernels.xla_int4_matmul import (  # noqa: E402
    SUBCHANNEL_FLAG,
    from_rtn,
    xla_int4_matmul,
    xla_int4_matmul_reference,
)

G = 128


def _weights(k, n, seed=0):
    w = jax.random.normal(jax.random.key(seed), (k, n), jnp.float32) * k**-0.5
    codes, scales, mins = quantize_rtn(w, G)  # symmetric
    return w, codes, scales, mins


def test_from_rtn_is_the_symmetric_rtn_grid():
    """codes - 8 in s4 times the scale is RTN's own dequantization (codes * scale + min)."""
    _, codes, scales, mins = _weights(256, 64)
    w4, s_bf16 = from_rtn(codes, scales)
    assert w4.dtype == jnp.int4 and s_bf16.dtype == jnp.bfloat16
    rtn = codes.astype(jnp.float32) * jnp.repeat(scales, G, 0) + jnp.repeat(mins, G, 0)
    ours = w4.astype(jnp.float32) * jnp.repeat(scales, G, 0)  # the f32 scales: exact
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(rtn))


@pytest.mark.parametrize("m", [1, 8, 33])
def test_matches_reference(m):
    w, codes, scales, _ = _weights(512, 256, seed=m)
    w4, s = from_rtn(codes, scales)
    x = jax.random.normal(jax.random.key(100 + m), (m, 512), jnp.float32).astype(jnp.bfloat16)
    got = np.asarray(jax.jit(xla_int4_matmul)(x, w4, s), np.float32)
    want = np.asarray(xla_int4_matmul_reference(x, w4, s))
    assert got.shape == (m, 256)
    assert np.max(np.abs(got - want)) <= 1e-2 * np.max(np.abs(want))
    # and close to the unquantized weight's product (RTN's error, not a layout mix-up)
    exact = np.asarray(x, np.float32) @ np.asarray(w)
    assert np.max(np.abs(want - exact)) <= 0.15 * np.max(np.abs(exact))


def test_refuses_wrong_shapes():
    _, codes, scales, _ = _weights(256, 64)
    w4, s = from_rtn(codes, scales)
    x = jnp.zeros((2, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="int4"):
        xla_int4_matmul(x, codes, s)
    with pytest.raises(ValueError, match="last dim"):
        xla_int4_matmul(jnp.zeros((2, 128), jnp.bfloat16), w4, s)
    with pytest.raises(ValueError, match="scales"):
        xla_int4_matmul(x, w4, s[:, :32])


K, N = 4096, 14336  # Llama-3-8B's gate/up projection


@pytest.fixture(scope="module")
def mesh():
    return deviceless.gpu_mesh(deviceless.target("h100"))


def _compile(mesh, m, options):
    from jax.sharding import NamedSharding, PartitionSpec

    rep = NamedSharding(mesh, PartitionSpec())
    args = (
        jax.ShapeDtypeStruct((m, K), jnp.bfloat16, sharding=rep),
        jax.ShapeDtypeStruct((K, N), jnp.int4, sharding=rep),
        jax.ShapeDtypeStruct((K // G, N), jnp.bfloat16, sharding=rep),
    )
    return deviceless.compile_for_gpu("xla_int4", jax.jit(xla_int4_matmul), args, {}, mesh, options)


def weight_sized_bf16(hlo: str) -> list[str]:
    """Entry instructions writing a bf16 array of the weight's K*N elements (its dequantization)."""
    comps, entry = parse_module(hlo)
    return [
        ins.name
        for ins in comps[entry]
        if ins.opcode not in ("parameter", "bitcast")
        and any(t == "bf16" and np.prod(d) == K * N for t, d in array_shapes(ins.shape))
    ]


def gemm_operand_types(hlo: str) -> set[str]:
    """Element types of the operands of the entry's Triton GEMM fusion."""
    comps, entry = parse_module(hlo)
    shapes = {ins.name: ins.shape for ins in comps[entry]}
    (gemm,) = [
        ins
        for ins in comps[entry]
        if ins.opcode == "fusion" and "gemm" in (attr(ins.attrs, "calls") or "")
    ]
    return {t for op in gemm.operands for t, _ in array_shapes(shapes.get(op.lstrip("%"), ""))}


@pytest.mark.parametrize("m", [1, 16, 64, 512])  # decode rows and a prefill chunk
def test_flag_fuses_the_dequantize_into_the_gemm(mesh, m):
    fused = _compile(mesh, m, {SUBCHANNEL_FLAG: "True"})
    assert weight_sized_bf16(fused.hlo) == [], fused.hlo
    assert "s4" in gemm_operand_types(fused.hlo)  # the GEMM reads the int4 weight itself
    default = _compile(mesh, m, {})
    assert len(weight_sized_bf16(default.hlo)) == 1, default.hlo  # the bf16 weight, written
    assert "s4" not in gemm_operand_types(default.hlo)


def test_under_the_layer_scan_each_int4_layer_is_copied_out_of_its_stack(mesh):
    """Why XLA-native INT4 is not the engine's decode path for the rows the INT4 kernels do not
    take (17-64): inside the model's layer scan, even with `SUBCHANNEL_FLAG`, XLA copies each
    layer's s4 weight out of its [L, K, N] stack before the GEMM (a `fused_dynamic_slice` and,
    in this layout, a transpose of the whole stack first); only the dequantize stays in the GEMM.
    The u32 packing of `int4_layout.py` (shift and mask) does not fuse into XLA's GEMM at all, and
    an unrolled loop converts the whole stack to bf16 (JOURNAL.md 59a). The
    INT4 kernels read the layer in place (`Int4Weight.matmul(x, layer=l)`); if a jax upgrade
    lets XLA do the same, this test fails and the 17-64-row choice should be measured again."""
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxserve.bench.gpu_report import report

    layers, m = 4, 64

    def step(x, params):
        def body(h, layer):
            w, s = params["w"][layer], params["scales"][layer]
            return xla_int4_matmul(h, w, s)[:, :K] + h, None

        return jax.lax.scan(body, x, jnp.arange(layers))[0]

    rep = NamedSharding(mesh, PartitionSpec())
    params = {
        "w": jax.ShapeDtypeStruct((layers, K, N), jnp.int4, sharding=rep),
        "scales": jax.ShapeDtypeStruct((layers, K // G, N), jnp.bfloat16, sharding=rep),
    }
    x = jax.ShapeDtypeStruct((m, K), jnp.bfloat16, sharding=rep)
    program = deviceless.compile_for_gpu(
        "int4_scan", jax.jit(step), (x, params), {}, mesh, {SUBCHANNEL_FLAG: "True"}
    )
    r = report(program, layers)
    layer_s4_bytes = K * N // 2
    assert r.weight_bytes_materialized >= layers * layer_s4_bytes, r.materialized
    assert weight_sized_bf16(program.hlo) == []  # the dequantize itself stays in the GEMM
