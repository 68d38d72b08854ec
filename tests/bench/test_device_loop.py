"""The device timing loop (`jaxserve.bench.device_loop`), compiled for an H100 with no GPU: each
op it times stays inside the loop's body, whole.

Why: the prepared GPU runs (experiments/gpu_kernels.py, gpu_quant_matmul.py) report a candidate's
time as the loop's time over its trip count. Whatever XLA hoists out of the loop (a weight's
dequantize, which depends on loop-invariant inputs only) runs once instead of every call, and the
figure flatters it; a kernel left outside would time nothing. The barriers on the loop's inputs
are what stops that, and these compiles check it.
"""

from __future__ import annotations

import pytest

from jaxserve.bench import deviceless

deviceless.prepare()  # before jax starts its backends (the CUDA plugin needs no driver then)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxserve.bench.device_loop import device_loop, seconds_per_call  # noqa: E402
from jaxserve.bench.xla_text import array_shapes, attr, parse_module  # noqa: E402
from pallas_kernels.attention.paged_kv import PagedKV  # noqa: E402
from pallas_kernels.attention.triton_decode import paged_attention  # noqa: E402
from pallas_kernels.xla_int4_matmul import SUBCHANNEL_FLAG, xla_int4_matmul  # noqa: E402

K, N, G = 4096, 14336, 128


@pytest.fixture(scope="module")
def mesh():
    return deviceless.gpu_mesh(deviceless.target("h100"))


def _sds(mesh, *shapes_dtypes):
    from jax.sharding import NamedSharding, PartitionSpec

    rep = NamedSharding(mesh, PartitionSpec())
    return tuple(jax.ShapeDtypeStruct(s, d, sharding=rep) for s, d in shapes_dtypes)


def body_and_rest(hlo: str):
    """(the instructions of the one while loop's body, the entry's: the program outside it).
    A fusion counts as one instruction (its output), as the runtime launches it."""
    comps, entry = parse_module(hlo)
    (loop,) = [ins for ins in comps[entry] if ins.opcode == "while"]
    return comps[attr(loop.attrs, "body")], comps[entry]


def weight_sized_bf16(instructions) -> list[str]:
    return [
        ins.name
        for ins in instructions
        if ins.opcode not in ("parameter", "bitcast", "get-tuple-element", "tuple", "opt-barrier")
        and any(t == "bf16" and np.prod(d) == K * N for t, d in array_shapes(ins.shape))
    ]


def test_the_kernel_runs_inside_the_loop(mesh):
    """The Triton decode kernel (batch 8, context 4096): its custom call is in the loop's body."""
    b, kvh, ps, w, d = 8, 8, 16, 256, 128
    args = _sds(
        mesh,
        ((b, 32, d), jnp.bfloat16),
        ((1, kvh, b * w, ps, d), jnp.bfloat16),
        ((1, kvh, b * w, ps, d), jnp.bfloat16),
        ((b,), jnp.int32),
        ((b, w), jnp.int32),
    )
    run = device_loop(lambda q, k, v, lens, pt: paged_attention(q, PagedKV(k, v), lens, pt), 4)
    program = deviceless.compile_for_gpu("loop", run, args, {}, mesh)
    body, rest = body_and_rest(program.hlo)
    assert any(ins.opcode == "custom-call" for ins in body), program.hlo
    assert not any(ins.opcode == "custom-call" for ins in rest)


@pytest.mark.parametrize("flag", [False, True])
def test_the_int4_dequantize_is_not_hoisted(mesh, flag):
    """XLA-native INT4 at decode (M = 8): XLA's default writes the bf16 weight every call, inside
    the loop (not once before it); with the subchannel flag, passed as the jit's option, the GEMM
    in the body reads the s4 weight and nothing weight-sized in bf16 is written anywhere."""
    args = _sds(mesh, ((8, K), jnp.bfloat16), ((K, N), jnp.int4), ((K // G, N), jnp.bfloat16))
    options = {"compiler_options": {SUBCHANNEL_FLAG: True}} if flag else {}
    run = device_loop(xla_int4_matmul, 4, **options)
    program = deviceless.compile_for_gpu("loop", run, args, {}, mesh)
    body, rest = body_and_rest(program.hlo)
    assert weight_sized_bf16(rest) == []
    assert len(weight_sized_bf16(body)) == (0 if flag else 1), program.hlo
    shapes = {ins.name: ins.shape for ins in body}
    gemm_types = {
        t
        for ins in body
        if ins.opcode == "fusion" and "gemm" in (attr(ins.attrs, "calls") or "")
        for op in ins.operands
        for t, _ in array_shapes(shapes.get(op.lstrip("%"), ""))
    }
    assert ("s4" in gemm_types) == flag, gemm_types


def test_seconds_per_call_runs_the_op(monkeypatch):
    """On the CPU: the loop calls op `iters` times per run (counted through a host callback)."""
    calls = []

    def op(x):
        jax.debug.callback(lambda: calls.append(1))
        return x * 2.0

    t = seconds_per_call(op, (jnp.ones((4,), jnp.float32),), iters=5, repeats=2)
    assert t > 0 and len(calls) == 5 * 3  # the warm-up run and 2 timed runs
