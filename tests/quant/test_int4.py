"""The packed INT4 layout: packing order, round trips, shape checks, and the model on INT4 params."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_testing import model_step, sequence_meta

from jaxserve.config import ModelConfig
from jaxserve.layers import kv_cache as kvc
from jaxserve.models import llama
from jaxserve.quant import Int4Weight, int4, pack, quantize_params, unpack, with_matmul_impl


def _random_weight(rng, lead, k, n, g):
    codes = rng.integers(0, 16, size=(*lead, k, n), dtype=np.uint8)
    scales = rng.uniform(0.01, 0.1, size=(*lead, k // g, n)).astype(np.float32)
    mins = rng.uniform(-1.0, 0.0, size=(*lead, k // g, n)).astype(np.float32)
    return codes, scales, mins


def test_nibble_order_matches_the_diagram():
    k, n = 2, 16  # N/8 = 2 packed columns
    codes = np.arange(k * n, dtype=np.uint8).reshape(k, n) % 16
    packed = np.asarray(int4.pack_codes(jnp.asarray(codes)))
    assert packed.shape == (k, n // 8) and packed.dtype == np.uint32
    for r in range(k):
        for c in range(n // 8):
            for j in range(8):
                assert (int(packed[r, c]) >> (4 * j)) & 0xF == codes[r, j * (n // 8) + c]


@pytest.mark.parametrize("lead,g", [((), 32), ((3,), 64), ((2,), 128)])
def test_pack_unpack_dequantize_round_trip(lead, g):
    rng = np.random.default_rng(0)
    codes, scales, mins = _random_weight(rng, lead, 256, 48, g)
    w = pack(codes, scales, mins, g)
    assert w.shape == (*lead, 256, 48) and w.group_size == g
    c2, s2, m2 = unpack(w)
    np.testing.assert_array_equal(np.asarray(c2), codes)
    np.testing.assert_array_equal(np.asarray(s2), scales.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(m2), mins.astype(np.float16).astype(np.float32))
    rep = lambda a: np.repeat(a.astype(np.float16).astype(np.float32), g, axis=-2)
    want = codes.astype(np.float32) * rep(scales) + rep(mins)
    np.testing.assert_array_equal(np.asarray(w.dequantize()), want)
    assert w.nbytes == int(np.prod(codes.shape)) // 2 + 2 * 2 * int(np.prod(scales.shape))


def test_bad_inputs_raise_value_errors():
    rng = np.random.default_rng(1)
    codes, scales, mins = _random_weight(rng, (), 128, 32, 32)
    with pytest.raises(ValueError, match="group_size"):
        pack(codes, scales, mins, 48)
    with pytest.raises(ValueError, match="multiple of group_size"):
        pack(codes[:96], scales[:3], mins[:3], 64)
    with pytest.raises(ValueError, match="scales has shape"):
        pack(codes, scales[:2], mins, 32)
    with pytest.raises(ValueError, match="0..15"):
        pack(codes.astype(np.int32) + 1, scales, mins, 32)
    with pytest.raises(ValueError, match="multiple of 8"):
        pack(codes[:, :12], scales[:, :12], mins[:, :12], 32)
    with pytest.raises(ValueError, match="float16"):
        pack(codes, scales * 1e6, mins, 32)
    w = pack(codes, scales, mins, 32)
    with pytest.raises(ValueError, match="mins has shape"):
        w.replace(mins=w.mins[:2]).dequantize()
    with pytest.raises(ValueError, match="last dim must be K"):
        w.matmul(jnp.ones((2, 64)))
    stacked = pack(np.stack([codes, codes]), np.stack([scales] * 2), np.stack([mins] * 2), 32)
    with pytest.raises(ValueError, match="one layer"):
        stacked.matmul(jnp.ones((2, 128)))
    with pytest.raises(ValueError, match="impl"):
        w.replace(impl="cuda").matmul(jnp.ones((2, 128)))


def test_matmul_xla_equals_reference_and_scans_over_a_layer_axis():
    rng = np.random.default_rng(2)
    w = pack(*_random_weight(rng, (3,), 128, 64, 64), 64)
    x = jnp.asarray(rng.normal(size=(2, 5, 128)), jnp.float32)

    @jax.jit
    def run(w, x):  # the weight is a pytree argument; scan slices its [L, ...] leaves
        def body(h, wl):
            assert isinstance(wl, Int4Weight) and wl.shape == (128, 64)
            return h, wl.matmul(x)

        return jax.lax.scan(body, 0.0, w)[1]

    got = run(w, x)  # (3, 2, 5, 64)
    deq = np.asarray(w.dequantize())
    want = np.einsum("btk,lkn->lbtn", np.asarray(x, np.float64), deq)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)


def _tiny_forward(params, config):
    b, t, ps = 2, 8, 8
    tokens = jnp.asarray(np.random.default_rng(3).integers(3, config.vocab_size, (b, t)), jnp.int32)
    meta = sequence_meta([[0], [1]], [0, 0], [t, t - 2], t, ps, 1)
    cache = kvc.init(
        config.num_layers, config.num_kv_heads, 2, ps, config.head_dim, "auto", jnp.float32
    )
    logits, _ = model_step(params, tokens, meta, cache, config)
    return np.asarray(logits)


@pytest.mark.parametrize("method", ["int4-rtn", "int8"])
def test_tiny_model_on_quantized_params_equals_dequantized_floats(method):
    config = ModelConfig.preset("tiny")
    params = llama.init_params(config, jax.random.key(0), jnp.float32)
    qparams = quantize_params(params, config, method, group_size=32)
    llama.check_params(qparams, config)  # same logical shapes
    assert type(qparams["layers"]["wq"]).__name__ in ("Int4Weight", "Int8Weight", "Fp8Weight")
    assert qparams["embed"].shape == (64, 128)  # quantized in the lm_head view [D, V]
    assert qparams["layers"]["attn_norm"].dtype == jnp.float32
    deq = dict(qparams, layers=dict(qparams["layers"]), embed=qparams["embed"].dequantize().T)
    deq["lm_head"] = qparams["lm_head"].dequantize()
    for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        deq["layers"][name] = qparams["layers"][name].dequantize()
    got, want, orig = (
        _tiny_forward(qparams, config),
        _tiny_forward(deq, config),
        _tiny_forward(params, config),
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    err = np.linalg.norm(got - orig) / np.linalg.norm(orig - orig.mean(-1, keepdims=True))
    assert 0 < err < 0.5, err  # really quantized, and close to the float model


def test_tiny_model_runs_the_pallas_kernel_inside_the_layer_scan():
    config = ModelConfig.preset("tiny")
    params = llama.init_params(config, jax.random.key(1), jnp.float32)
    q = quantize_params(params, config, "int4-rtn-asym", group_size=32)
    forced = with_matmul_impl(q, "pallas_interpret")
    assert forced["layers"]["w_down"].impl == "pallas_interpret" and q["lm_head"].impl == "xla"
    np.testing.assert_allclose(
        _tiny_forward(forced, config), _tiny_forward(q, config), rtol=1e-5, atol=1e-5
    )


def test_with_matmul_impl_replaces_only_the_int4_impl():
    config = ModelConfig.preset("tiny")
    params = llama.init_params(config, jax.random.key(2), jnp.float32)
    q = quantize_params(params, config, "int4-rtn", group_size=32, embedding_method="int8")
    assert {w.impl for w in jax.tree.leaves(q, is_leaf=_is_int4) if _is_int4(w)} == {"xla"}
    out = with_matmul_impl(q, "pallas")
    # The same arrays; only the treedef's static field differs (a jit retraces for a new impl).
    assert all(a is b for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(q), strict=True))
    for (path, a), (_, b) in zip(
        jax.tree_util.tree_leaves_with_path(q, is_leaf=_is_int4),
        jax.tree_util.tree_leaves_with_path(out, is_leaf=_is_int4),
        strict=True,
    ):
        if _is_int4(a):
            assert b.impl == "pallas" and b.group_size == a.group_size, path
            assert b.packed is a.packed and b.scales is a.scales and b.mins is a.mins, path
        else:
            assert b is a, path  # float leaves and the INT8 table untouched
    assert type(out["embed"]).__name__ == "Int8Weight"
    # Abstract params (what a GPU lowering test builds) work too; the original is not mutated.
    abstract = with_matmul_impl(jax.eval_shape(lambda: q), "pallas")
    assert abstract["layers"]["wq"].impl == "pallas" and q["layers"]["wq"].impl == "xla"
    for bad in ("auto", "gpu"):
        with pytest.raises(ValueError, match="impl must be one of"):
            with_matmul_impl(q, bad)


def _is_int4(x) -> bool:
    return isinstance(x, Int4Weight)


def test_quantize_params_errors_name_the_weight():
    config = ModelConfig.preset("tiny")
    params = llama.init_params(config, jax.random.key(0), jnp.float32)
    with pytest.raises(ValueError, match="unknown quantization method"):
        quantize_params(params, config, "int3", 32)
    with pytest.raises(ValueError, match=r"layers/wq .*in=64"):
        quantize_params(params, config, "int4-rtn", 128)
    q = quantize_params(params, config, "int4-rtn", 64)
    with pytest.raises(ValueError, match="already quantized"):
        quantize_params(q, config, "int4-rtn", 64)


def test_untied_lm_head_is_quantized():
    config = ModelConfig.preset("tiny")  # tiny unties embeddings
    assert not config.tie_word_embeddings
    params = llama.init_params(config, jax.random.key(0), jnp.float32)
    q = quantize_params(params, config, "int4-rtn", 64)
    assert isinstance(q["lm_head"], Int4Weight) and q["lm_head"].shape == (64, 128)


def test_default_group_size_is_the_largest_that_divides_every_input_dim():
    from jaxserve.quant import default_group_size

    tiny = ModelConfig.preset("tiny")  # input dims 64 and 128
    smol = ModelConfig.preset("smollm2-135m")  # 576 and 1536
    llama3 = ModelConfig.preset("llama3-8b")
    for config, want in ((tiny, 64), (smol, 64), (llama3, 128)):
        abstract = jax.eval_shape(lambda k, c=config: llama.init_params(c, k), jax.random.key(0))
        assert default_group_size(abstract, config) == want


def test_mgpu_impl_runs_the_mosaic_kernel_where_it_accepts_the_call(monkeypatch):
    """impl 'mgpu_interpret' (`quant/impls.py`): bf16 rows of a stack's traced layer run the Mosaic
    GPU W4A16 kernel (interpreted); f32 rows, and N under its 128-column tile, the Triton kernel's
    interpreter. Each equals XLA's unpack + dot on that layer."""
    calls = []
    real_mgpu, real_triton = int4.int4_matmul_mgpu, int4.int4_matmul
    monkeypatch.setattr(
        int4, "int4_matmul_mgpu", lambda *a, **k: calls.append("mgpu") or real_mgpu(*a, **k)
    )
    monkeypatch.setattr(
        int4, "int4_matmul", lambda *a, **k: calls.append(k["impl"]) or real_triton(*a, **k)
    )
    rng = np.random.default_rng(4)
    for n, dtype, want_call in ((128, jnp.bfloat16, "mgpu"), (128, jnp.float32, "pallas_interpret"),
                                (64, jnp.bfloat16, "pallas_interpret")):  # fmt: skip
        w = pack(*_random_weight(rng, (3,), 128, n, 64), 64)
        x = jnp.asarray(rng.normal(size=(8, 128)), dtype)
        calls.clear()
        got = jax.jit(
            lambda x, layer, w=w: w.replace(impl="mgpu_interpret").matmul(x, layer=layer)
        )(x, jnp.int32(1))
        assert calls == [want_call], (n, dtype, calls)
        one = jax.tree.map(lambda a: a[1], w)
        want = np.asarray(one.matmul(x), np.float32)
        tol = (2e-2 if dtype == jnp.bfloat16 else 1e-4) * np.abs(want).max()
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0, atol=tol)
