"""Block-wise refinement of INT4 scales/mins: lowers the layer-output error, keeps the codes."""

import jax.numpy as jnp
import numpy as np
import pytest
from ptq_testing import hidden_states, tiny_params

from jaxserve.config import ModelConfig
from jaxserve.models import llama
from jaxserve.quant import Int4Weight, calibration, gptq, int4, refine

LINEARS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def _setup(seed=0):
    c = ModelConfig.preset("tiny")
    p = tiny_params(c, seed=seed)
    calib = np.random.default_rng(seed).integers(0, c.vocab_size, (8, 32)).astype(np.int32)
    return c, p, calib


@pytest.mark.parametrize("per_token", [False, True])
def test_refine_layer_lowers_the_loss_and_keeps_codes(per_token):
    c, p, calib = _setup()
    x = p["embed"][calib]
    lp = calibration.layer_slice(p, 0)
    y, _ = calibration.layer_forward(lp, x, c)
    _, st = calibration._run_layer(lp, x, c, 4, True)
    qlp = gptq.gptq_layer(lp, st, 32)
    rc = refine.RefineConfig(steps=40, batch=4, lr=3e-3, per_token=per_token)
    new, info = refine.refine_layer(qlp, x, y, c, rc)
    assert info["kept"] and info["loss_after"] < 0.95 * info["loss_before"], info
    # The reported loss is the true one of the returned (f16-rounded) params, up to that rounding.
    err = (calibration.layer_forward(calibration.float_view(new), x, c)[0] - y) ** 2
    if per_token:  # each token's squared error relative to its own squared norm
        got = float(jnp.mean(jnp.sum(err, -1) / jnp.sum(y**2, -1)))
    else:
        got = float(jnp.mean(err) / jnp.mean(y**2))
    assert got == pytest.approx(info["loss_after"], rel=0.05)
    for n in LINEARS:
        assert isinstance(new[n], Int4Weight) and new[n].group_size == qlp[n].group_size
        new[n].check()
        np.testing.assert_array_equal(np.asarray(new[n].packed), np.asarray(qlp[n].packed))
        assert new[n].scales.dtype == int4.STORED_DTYPE
    assert not np.array_equal(np.asarray(new["w_down"].scales), np.asarray(qlp["w_down"].scales))
    assert not np.allclose(np.asarray(new["mlp_norm"]), np.asarray(qlp["mlp_norm"]))


def test_refine_keeps_the_input_when_it_cannot_improve():
    c, p, calib = _setup(1)
    x = p["embed"][calib]
    lp = calibration.layer_slice(p, 0)
    y, _ = calibration.layer_forward(lp, x, c)
    _, st = calibration._run_layer(lp, x, c, 4, True)
    qlp = gptq.gptq_layer(lp, st, 32)
    # A huge learning rate overshoots: the refinement must give back GPTQ's params unchanged.
    new, info = refine.refine_layer(qlp, x, y, c, refine.RefineConfig(steps=3, lr=10.0))
    assert not info["kept"] and info["loss_after"] >= info["loss_before"], info
    assert new is qlp


def test_quantize_gptq_with_refinement_beats_plain_gptq_on_hidden_states():
    c, p, calib = _setup(2)
    plain = gptq.quantize_gptq(p, c, 32, calib)
    refined = gptq.quantize_gptq(
        p, c, 32, calib, refine_config=refine.RefineConfig(steps=24, lr=3e-3)
    )
    llama.check_params(refined, c)

    def hidden(params):
        return hidden_states(params, p["embed"][calib], c)

    ref = hidden(p)
    e_plain = float(jnp.mean((hidden(plain) - ref) ** 2))
    e_ref = float(jnp.mean((hidden(refined) - ref) ** 2))
    assert e_ref < 0.95 * e_plain, (e_ref, e_plain)


def test_refine_holdout_keeps_the_best_held_out_step():
    c, p, calib = _setup(0)
    x = p["embed"][calib]
    lp = calibration.layer_slice(p, 0)
    y, _ = calibration.layer_forward(lp, x, c)
    _, st = calibration._run_layer(lp, x[:6], c, 4, True)
    qlp = gptq.gptq_layer(lp, st, 32)
    rc = refine.RefineConfig(steps=24, batch=2, lr=3e-3, holdout=2, eval_every=8)
    new, info = refine.refine_layer(qlp, x, y, c, rc)
    assert info["kept"] and info["best_step"] in (8, 16, 24), info
    assert info["holdout_after"] < info["holdout_before"]
    # The returned params score the reported held-out loss (up to the f16 rounding of scales).
    err = (calibration.layer_forward(calibration.float_view(new), x[6:], c)[0] - y[6:]) ** 2
    assert float(jnp.mean(err) / jnp.mean(y[6:] ** 2)) == pytest.approx(
        info["holdout_after"], rel=0.05
    )
    # Overshooting from the first step: step 0 (GPTQ's own params) stays best.
    bad = refine.RefineConfig(steps=4, lr=10.0, holdout=2, eval_every=2)
    same, info = refine.refine_layer(qlp, x, y, c, bad)
    assert same is qlp and info["best_step"] == 0 and not info["kept"]


def test_refine_bad_input_names_the_problem():
    with pytest.raises(ValueError, match="steps >= 0"):
        refine.RefineConfig(steps=-1)
    with pytest.raises(ValueError, match="lr > 0"):
        refine.RefineConfig(lr=0.0)
    with pytest.raises(ValueError, match="holdout >= 0"):
        refine.RefineConfig(holdout=-1)
    c, p, calib = _setup()
    stats = calibration.collect_stats(p, c, calib)
    with pytest.raises(ValueError, match="refinement needs calibration tokens"):
        gptq.quantize_gptq(p, c, 32, stats, refine_config=refine.RefineConfig(steps=2))
