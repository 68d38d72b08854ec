"""AWQ: scale search beats RTN when a few input channels carry outliers; folding keeps the network."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ptq_testing import tiny_params

from jaxserve.config import ModelConfig
from jaxserve.models import llama
from jaxserve.quant import Int4Weight, awq, calibration, rtn


def _outlier_inputs(k=256, n=64, tokens=2048, seed=0):
    """Inputs whose first 8 channels are 30x larger (as LLM activations are); returns W, H, mean|x|."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(tokens, k)).astype(np.float32)
    x[:, :8] *= 30.0
    w = rng.normal(size=(k, n)).astype(np.float32) * 0.05
    return w, x.T @ x / tokens, np.abs(x).mean(axis=0)


def _err(w, h, wq):
    e = np.asarray(wq, np.float64) - w
    return float(np.sum(e * (h @ e)))


@pytest.mark.parametrize("g", [32, 128])
def test_awq_scales_and_clipping_beat_rtn_with_outlier_channels(g):
    w, h, am = _outlier_inputs()
    e_rtn = _err(w, h, rtn.quantize_int4_rtn(jnp.asarray(w), g, symmetric=False).dequantize())
    s, errs = awq.search_scale(jnp.asarray(w), jnp.asarray(h), jnp.asarray(am), g)
    s = np.asarray(s)
    # alpha = 0 (s = 1) is RTN itself: the search can only improve on it.
    np.testing.assert_allclose(float(errs[0]), e_rtn, rtol=1e-3)
    assert s[:8].min() > s[8:].max()  # the outlier channels are scaled up
    hs = jnp.asarray(h / np.outer(s, s))
    codes, scales, mins = awq.quantize_clipped(jnp.asarray(w * s[:, None]), hs, g, clip=True)
    q = calibration.pack_int4(codes, scales, mins, g)
    e_awq = _err(w, h, np.asarray(q.dequantize()) / s[:, None])
    assert e_awq < 0.6 * e_rtn, (e_awq, e_rtn)


_rtn = jax.jit(rtn.quantize_int4_rtn, static_argnums=(1, 2))


def _outlier_model():
    """The tiny model with a few norm channels 20x larger: its linears see outlier inputs."""
    c = ModelConfig.preset("tiny")
    p = tiny_params(c, seed=1)
    boost = jnp.ones((c.hidden_size,)).at[:4].set(20.0)
    layers = dict(p["layers"])
    layers["attn_norm"] = layers["attn_norm"] * boost
    layers["mlp_norm"] = layers["mlp_norm"] * boost
    return c, {**p, "layers": layers}


def _hidden(p, params, c, tokens):
    x = p["embed"][tokens]
    for i in range(c.num_layers):
        x, _ = calibration.layer_forward(
            calibration.float_view(calibration.layer_slice(params, i)), x, c
        )
    return x


def test_quantize_awq_tiny_model_folds_scales_and_beats_rtn():
    c, p = _outlier_model()
    calib = np.random.default_rng(0).integers(0, c.vocab_size, (4, 32)).astype(np.int32)
    stats = calibration.collect_stats(p, c, calib)
    q = awq.quantize_awq(p, c, 32, stats)
    llama.check_params(q, c)
    assert isinstance(q["layers"]["wq"], Int4Weight) and q["layers"]["wq"].group_size == 32
    # Scales were folded into the norms (the float norm weights changed) ...
    assert not np.allclose(
        np.asarray(q["layers"]["attn_norm"]), np.asarray(p["layers"]["attn_norm"])
    )
    r = dict(p["layers"])
    for n in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        r[n] = _rtn(p["layers"][n], 32, False)
    ref = _hidden(p, p, c, calib)
    e_awq = float(jnp.mean((_hidden(p, q, c, calib) - ref) ** 2))
    e_rtn = float(jnp.mean((_hidden(p, {**p, "layers": r}, c, calib) - ref) ** 2))
    # ... and the quantized network is closer to the float one than RTN's.
    assert e_awq < 0.7 * e_rtn, (e_awq, e_rtn)


def test_awq_bad_input_names_the_problem():
    c, p = _outlier_model()
    with pytest.raises(ValueError, match="one LayerStats per layer"):
        awq.quantize_awq(p, c, 32, calib=[])
    with pytest.raises(ValueError, match="group_size 128 does not divide the input dim 64"):
        calibration.group_size_for("layers/wq", 64, 128)
    assert calibration.group_size_for("layers/wq", 576, 128, allow_smaller=True) == 64


def test_duo_scale_search_never_loses_to_the_activation_only_search():
    w, h, am = _outlier_inputs(seed=3)
    w[:, :4] *= 8.0  # a few large output columns: the weight statistic differs from the inputs'
    w, h, am = jnp.asarray(w), jnp.asarray(h), jnp.asarray(am)
    s1, errs = awq.search_scale(w, h, am, 32)
    s2, errs2 = awq.search_scale(w, h, am, 32, duo=True)
    np.testing.assert_allclose(np.asarray(errs2), np.asarray(errs))  # the a^alpha family's errors
    e = lambda s: float(
        jnp.sum((d := awq.fake_quant(w * s[:, None], 32) / s[:, None] - w) * (h @ d))
    )
    assert e(s2) <= e(s1) * (1 + 1e-6)
    mag = awq.weight_magnitude(w, 32)
    assert mag.shape == (256,) and float(mag.max()) <= 1.0
