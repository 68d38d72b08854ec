"""GPTQ: error compensation beats RTN on correlated inputs; act-order keeps the contiguous layout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ptq_testing import hidden_states, tiny_params

from jaxserve.config import ModelConfig
from jaxserve.models import llama
from jaxserve.quant import Int4Weight, calibration, gptq, int4, rtn

_rtn = jax.jit(rtn.quantize_int4_rtn, static_argnums=(1, 2))


def _correlated(k=256, n=64, seed=0):
    """A random weight and the input second moment H = E[x x^T] = A^T A of inputs x = z A (z white):
    strongly correlated channels. Returns (W f32[k, n], H f64[k, k])."""
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(k, k)) * 0.3 + np.eye(k)
    w = rng.normal(size=(k, n)).astype(np.float32) * 0.05
    return w, a.T @ a


def _out_err(w, h, wq):
    e = np.asarray(wq, np.float64) - w
    return float(np.sum(e * (h @ e)))  # ||X (Wq - W)||^2 / n


def _rtn_err(w, h, g):
    return _out_err(w, h, rtn.quantize_int4_rtn(jnp.asarray(w), g, symmetric=False).dequantize())


@pytest.mark.parametrize("g", [32, 128])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_rtn_on_correlated_inputs(g, act_order):
    w, h = _correlated()
    # damp 0.1: the algorithm's own compensation (the model recipe's larger DEFAULT_DAMP trades
    # some of it for robustness, see gptq.py).
    codes, scales, mins = gptq.gptq_matrix(w, h, g, act_order=act_order, damp=0.1)
    packed = int4.pack(codes, scales, mins, g)
    # The codes were computed against the stored (f16) grid: packing changes nothing.
    np.testing.assert_array_equal(np.asarray(int4.unpack(packed)[0]), codes)
    np.testing.assert_array_equal(np.asarray(packed.scales, np.float32), scales)
    err = _out_err(w, h, packed.dequantize())
    assert err < 0.65 * _rtn_err(w, h, g), (err, _rtn_err(w, h, g))


def test_act_order_uses_contiguous_groups_and_natural_row_order():
    w, h = _correlated(k=128, n=16, seed=1)
    d = np.linspace(5.0, 0.2, 128)  # input scales: activity falls with the row index
    h = h * np.outer(d, d)
    codes, scales, mins = gptq.gptq_matrix(w, h, 32, act_order=True)
    deq = codes.astype(np.float32) * np.repeat(scales, 32, 0) + np.repeat(mins, 32, 0)
    # Rows come back in natural order: each dequantized row is close to its own original row.
    assert np.abs(deq - w).max() < 0.5 * np.abs(w).max()
    # Static groups: every group's grid spans exactly its own contiguous rows of the original W.
    wg = w.reshape(4, 32, 16)
    np.testing.assert_allclose(mins, wg.min(axis=1), atol=1e-3)
    np.testing.assert_allclose(scales, (wg.max(axis=1) - wg.min(axis=1)) / 15, rtol=2e-3)


def test_gptq_bad_input_names_the_problem():
    w, h = _correlated(k=96, n=8)
    with pytest.raises(ValueError, match="not a multiple of group_size"):
        gptq.gptq_matrix(w, h, 64)
    with pytest.raises(ValueError, match="hessian has shape"):
        gptq.gptq_matrix(w, h[:64, :64], 32)
    c = ModelConfig.preset("tiny")
    p = {"layers": {}}
    with pytest.raises(ValueError, match="calibration tokens"):
        gptq.quantize_gptq(p, c, 32, calib=None)


def test_quantize_gptq_tiny_model_beats_rtn_on_hidden_states():
    c = ModelConfig.preset("tiny")
    p = tiny_params(c)
    calib = np.random.default_rng(0).integers(0, c.vocab_size, (4, 32)).astype(np.int32)
    q = gptq.quantize_gptq(p, c, 32, calib, act_order=True)
    assert isinstance(q["layers"]["w_down"], Int4Weight)
    assert q["layers"]["wq"].shape == p["layers"]["wq"].shape
    llama.check_params(q, c)
    r_params = {**p, "layers": dict(p["layers"])}
    for n in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        r_params["layers"][n] = _rtn(p["layers"][n], 32, False)

    def hidden(params):
        return hidden_states(params, p["embed"][calib], c)

    ref = hidden(p)
    e_gptq = float(jnp.mean((hidden(q) - ref) ** 2))
    e_rtn = float(jnp.mean((hidden(r_params) - ref) ** 2))
    assert e_gptq < 0.8 * e_rtn, (e_gptq, e_rtn)


def test_gptq_on_float_stats_with_awq_scales_keeps_the_network():
    """The one-pass mode (float-model LayerStats) with AWQ's folded scales: still closer than RTN."""
    c = ModelConfig.preset("tiny")
    p = tiny_params(c, seed=3)
    calib = np.random.default_rng(1).integers(0, c.vocab_size, (4, 32)).astype(np.int32)
    stats = calibration.collect_stats(p, c, calib)
    q = gptq.quantize_gptq(p, c, 32, stats, awq_scales=True)
    assert not np.allclose(np.asarray(q["layers"]["mlp_norm"]), 1.0)  # scales were folded
    x, xq, xr = (p["embed"][calib],) * 3
    for i in range(c.num_layers):
        x, _ = calibration.layer_forward(calibration.layer_slice(p, i), x, c)
        lq = calibration.float_view(calibration.layer_slice(q, i))
        xq, _ = calibration.layer_forward(lq, xq, c)
        lr = calibration.layer_slice(p, i)
        lr = {k: _rtn(v, 32, False) if k.startswith("w") else v for k, v in lr.items()}
        xr, _ = calibration.layer_forward(calibration.float_view(lr), xr, c)
    assert float(jnp.mean((xq - x) ** 2)) < 0.8 * float(jnp.mean((xr - x) ** 2))


def test_gptq_clip_search_lowers_the_error_of_heavy_tailed_weights():
    w, h = _correlated(k=128, n=32, seed=2)
    w = w * np.random.default_rng(3).standard_t(2, size=w.shape).astype(np.float32)  # outliers
    plain = gptq.gptq_matrix(w, h, 32)
    clipped = gptq.gptq_matrix(w, h, 32, clip=True)
    errs = [_out_err(w, h, int4.pack(*r, 32).dequantize()) for r in (plain, clipped)]
    assert errs[1] < errs[0], errs


def test_gptq_clip_search_with_act_order_only_shrinks_the_static_groups():
    w, h = _correlated(k=128, n=32, seed=2)
    _, s_plain, m_plain = gptq.gptq_matrix(w, h, 32, act_order=True)
    _, s_clip, m_clip = gptq.gptq_matrix(w, h, 32, act_order=True, clip=True)
    # Ratios are <= 1 of the contiguous group's own [min, max]; some groups are shrunk.
    assert np.all(s_clip <= s_plain * (1 + 2e-3)) and np.any(s_clip < s_plain * 0.99)
    assert np.all(m_clip >= m_plain - 1e-3)
