import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import matmul as cpu_matmul
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.layers.linear import TransposedWeight, cpu_layout, linear, linears, matmul
from jaxserve.layers.linear import transposed as transposed_weight
from jaxserve.resolve import resolve

_TINY = ModelConfig.preset("tiny")
CPU_ROWS = resolve(EngineConfig().for_model(_TINY), _TINY, "cpu").model.min_matmul_rows


@pytest.mark.parametrize("lead", [(1,), (1, 1), (3,), (2, 5)])
@pytest.mark.parametrize("transposed", [False, True])
def test_matmul_equals_einsum(lead, transposed):
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (*lead, 24), jnp.float32)
    w = jax.random.normal(kw, (40, 24) if transposed else (24, 40), jnp.float32)
    want = jnp.einsum("...i,oi->...o" if transposed else "...i,io->...o", x, w)
    got = matmul(x, w, transposed=transposed)
    assert got.shape == (*lead, 40)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transposed", [False, True])
def test_a_row_gets_the_same_bits_among_few_or_many_rows(transposed):
    """Rows padded up to min_rows (CPU_ROWS, what `resolve` picks on CPU) give the numbers those
    rows get among others (SmolLM2's 576-wide hidden state; bf16 in, f32 out, as tied logits)."""
    kx, kw = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (8, 576), jnp.bfloat16)
    w = jax.random.normal(kw, (1024, 576) if transposed else (576, 1024), jnp.bfloat16)
    many = np.asarray(matmul(x, w, transposed=transposed, out_dtype=jnp.float32))
    for m in (1, 2, 3, 4):
        few = matmul(x[:m], w, transposed=transposed, out_dtype=jnp.float32, min_rows=CPU_ROWS)
        assert few.dtype == jnp.float32 and few.shape == (m, 1024)
        np.testing.assert_array_equal(np.asarray(few), many[:m], err_msg=f"{m} rows")


def test_linear_keeps_the_input_dtype():
    x = jnp.ones((1, 8), jnp.bfloat16)
    w = jnp.ones((8, 4), jnp.float32)
    y = linear(x, w)
    assert y.dtype == jnp.bfloat16 and y.shape == (1, 4)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.full((1, 4), 8.0))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the padding is a CPU code path")
def test_one_row_bf16_dot_does_not_convert_the_weight_on_cpu():
    """XLA's CPU one-row bf16 dot converts the whole weight to f32 first (43 ms for SmolLM2's
    tied logits); `matmul` pads to CPU_ROWS rows, so no f32 copy of the weight is in the program."""
    x = jax.ShapeDtypeStruct((1, 1, 64), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((512, 64), jnp.bfloat16)

    def f(x, w):
        return matmul(x, w, transposed=True, out_dtype=jnp.float32, min_rows=CPU_ROWS)

    def plain(x, w):
        return jnp.einsum("...d,vd->...v", x, w, preferred_element_type=jnp.float32)

    hlo = jax.jit(f).lower(x, w).compile().as_text()
    assert "f32[512,64]" not in hlo
    # The check can fail: the unpadded dot does carry the converted weight.
    assert "f32[512,64]" in jax.jit(plain).lower(x, w).compile().as_text()


def test_transposed_weight_multiplies_as_the_weight_it_stores():
    """A [L, in, out] stack stored [L, out, in]: same logical shape, same products, whole or one
    layer at a time (the `linear(layer=)` slice and a `lax.scan` over the stack)."""
    kx, kw = jax.random.split(jax.random.key(2))
    x = jax.random.normal(kx, (5, 24), jnp.float32)
    w = jax.random.normal(kw, (3, 24, 40), jnp.float32)
    t = TransposedWeight.of(w)
    assert t.shape == (3, 24, 40) and t.t.shape == (3, 40, 24) and t.dtype == jnp.float32
    want = np.einsum("ni,lio->lno", np.asarray(x), np.asarray(w))
    for layer in range(3):
        got = jax.jit(linear)(x, t, jnp.int32(layer))
        np.testing.assert_allclose(np.asarray(got), want[layer], rtol=1e-5, atol=1e-5)

    def body(carry, lw):  # the scan slices the pytree's leaf on its layer axis
        return carry, linear(x, lw)

    _, ys = jax.lax.scan(body, 0, t)
    np.testing.assert_allclose(np.asarray(ys), want, rtol=1e-5, atol=1e-5)


def test_cpu_layout_transposes_only_plain_stacked_linear_weights():
    layers = {
        "attn_norm": jnp.ones((2, 8)),  # norms and biases: 2-D, unchanged
        "bq": jnp.zeros((2, 4)),
        "wq": jnp.arange(2 * 8 * 4, dtype=jnp.float32).reshape(2, 8, 4),
    }
    out = cpu_layout(layers)
    assert out["attn_norm"] is layers["attn_norm"] and out["bq"] is layers["bq"]
    assert isinstance(out["wq"], TransposedWeight) and out["wq"].shape == (2, 8, 4)
    np.testing.assert_array_equal(
        np.asarray(out["wq"].t), np.swapaxes(np.asarray(layers["wq"]), 1, 2)
    )


def test_linears_run_kernel_weights_as_one_call_and_others_one_by_one():
    """`linears`: bf16 weights for the C++ CPU matmul go into one `matmul_many` call (one
    custom call in the program), with the bits each gets alone; any other weight falls back to
    `linear` each."""
    if not cpu_matmul.available():
        pytest.fail(f"the CPU matmul kernel must build here: {cpu_matmul.build_error()}")
    kx, kw = jax.random.split(jax.random.key(3))
    x = jax.random.normal(kx, (3, 5, 64), jnp.float32).astype(jnp.bfloat16)
    stacks = [jax.random.normal(k, (2, 64, n)).astype(jnp.bfloat16) for k, n in
              zip(jax.random.split(kw, 3), (64, 16, 16))]  # fmt: skip
    ws = [transposed_weight(w, kernel=True) for w in stacks]
    f = jax.jit(lambda x, ws, i: linears(x, ws, layer=i))
    got = f(x, ws, jnp.int32(1))
    for y, w in zip(got, ws):
        np.testing.assert_array_equal(np.asarray(y), np.asarray(linear(x, w, layer=1)))
    hlo = f.lower(x, ws, jnp.int32(1)).as_text()
    assert hlo.count("jaxserve_matmul_many") == 1 and 'jaxserve_matmul"' not in hlo
    plain = [transposed_weight(w) for w in stacks]  # XLA's dot: one by one
    for y, w in zip(linears(x, plain, layer=0), plain):
        np.testing.assert_array_equal(np.asarray(y), np.asarray(linear(x, w, layer=0)))


def test_fused_projections_compute_each_weights_product():
    """`fuse_projections` (the GPU's layout): q/k/v and gate/up stacks of every layer become one
    `FusedWeight` each, whose one product splits into each weight's; weights of other shapes
    (a quantized or partial stack, a bias, wo) are left as they were."""
    from jaxserve.layers.linear import FusedWeight, fuse_projections, fused_name

    ks = jax.random.split(jax.random.key(3), 8)
    layers = {
        "wq": jax.random.normal(ks[0], (3, 16, 32)),
        "wk": jax.random.normal(ks[1], (3, 16, 8)),
        "wv": jax.random.normal(ks[2], (3, 16, 8)),
        "wo": jax.random.normal(ks[3], (3, 32, 16)),
        "w_gate": jax.random.normal(ks[4], (2, 16, 24)),  # a mixed model's dense layers only
        "w_up": jax.random.normal(ks[5], (2, 16, 24)),
        "bq": jax.random.normal(ks[6], (3, 32)),
    }
    out = fuse_projections(layers, num_layers=3)
    assert sorted(out) == ["bq", "w_gate", "w_up", "wo", "wq+wk+wv"]
    fused = out[fused_name(("wq", "wk", "wv"))]
    assert (
        isinstance(fused, FusedWeight) and fused.outs == (32, 8, 8) and fused.shape == (3, 16, 48)
    )
    x = jax.random.normal(ks[7], (5, 16))
    layer = jax.tree.map(lambda a: a[1], fused)  # what the layer scan hands a layer
    for name, y in zip(("wq", "wk", "wv"), layer.split(linear(x, layer.w))):
        np.testing.assert_allclose(
            np.asarray(y), np.asarray(x @ layers[name][1]), rtol=1e-5, atol=1e-5
        )
    assert fuse_projections({"wq": layers["wq"]}, 3) == {"wq": layers["wq"]}  # no k, v: unchanged
