"""A quantized weight's `kernel_rows`: the rows up to which its kernel impl runs the kernel, XLA's
path above, set with the impl from the engine's GPU's row of the GPU kernel table
(`quant.with_matmul_impl`, `Resolved.quant_kernel_rows`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxserve.quant import int4, int8, with_matmul_impl
from jaxserve.quant.int8 import quantize_fp8, quantize_int8
from jaxserve.quant.rtn import quantize_int4_rtn


def stacks() -> dict:
    w = jnp.ones((2, 128, 128), jnp.float32)
    return {"a": quantize_int4_rtn(w, 64), "b": quantize_int8(w), "c": quantize_fp8(w), "d": w}


def runs_kernel(w, rows: int) -> bool:
    """Whether w.matmul on `rows` bf16 rows of layer 0 traces a Pallas kernel (traced only: the
    GPU kernels need no GPU to trace)."""
    x = jnp.ones((rows, 128), jnp.bfloat16)
    return "pallas_call" in str(jax.make_jaxpr(lambda x: w.matmul(x, layer=0))(x))


def test_with_matmul_impl_sets_each_types_rows():
    params = with_matmul_impl(stacks(), "pallas", (("int4_matmul", 4), ("w8_matmul", 8)))
    assert [params[k].kernel_rows for k in "abc"] == [4, 8, 8]
    assert all(params[k].impl == "pallas" for k in "abc") and isinstance(params["d"], jax.Array)
    # none given: each type's default, whatever the weight held before
    again = with_matmul_impl(params, "mgpu")
    assert [again[k].kernel_rows for k in "abc"] == [
        int4.PALLAS_MAX_ROWS,
        int8.PALLAS_MAX_ROWS,
        int8.PALLAS_MAX_ROWS,
    ]
    with pytest.raises(ValueError, match="kernel_rows names ops"):
        with_matmul_impl(params, "pallas", {"int8_matmul": 4})
    with pytest.raises(ValueError, match="kernel_rows must be an int >= 0"):
        params["a"].replace(kernel_rows=-1).check()


@pytest.mark.parametrize("key", ["a", "b"])
def test_the_kernel_runs_up_to_its_rows(key):
    w = stacks()[key]
    for limit, rows, kernel in ((16, 8, True), (8, 8, True), (4, 8, False), (0, 1, False)):
        got = with_matmul_impl({"w": w}, "pallas", {"int4_matmul": limit, "w8_matmul": limit})
        assert runs_kernel(got["w"], rows) == kernel, (limit, rows)
