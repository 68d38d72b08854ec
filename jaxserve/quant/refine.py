"""Block-wise refinement of INT4 group scales and mins with optax, after GPTQ fixed the codes.

GPTQ (and AWQ) choose each linear's codes against a per-linear objective, ||X (W - Q)||^2 with the
linear's own inputs. What the model needs is the *layer's* output, and on SmolLM2 the per-linear
objective is a poor proxy: w_down's input second moment is dominated by the attention-sink token
(see `gptq.DEFAULT_DAMP`). This module keeps the integer codes GPTQ chose and tunes the continuous
parameters of the packed layout — every group's (scale, min), and optionally the layer's two RMSNorm
weights — so the quantized layer reproduces the float layer:

    for each layer i (in order; x_q: the output of the already-quantized layers 0..i-1,
                      y_f: the float layer i applied to the float model's own input x_f):
        qlp = quantize_layer(lp_i, stats(x_q))          GPTQ on AWQ scales: codes q, scales s0, mins m0
        s = s0 * (1 + a),  m = m0 + s0 * b               a, b f32[K/g, N] per linear, start at 0
        minimize  mean_t || layer(q * s + m; x_q)_t - y_f,t ||^2 / mean(y_f^2)   over a, b (, norms)
                  with Adam on minibatches of calibration windows
        keep the result only if the loss over all windows went down; store s, m rounded to f16

Because the codes stay fixed, W_hat = q * s + m is linear in (s, m): the objective is smooth (no
straight-through rounding; an earlier per-linear clip refinement that moved the rounding grid made
things worse), and the packed layout is unchanged, so nothing downstream knows. Targets are the
FLOAT layer's outputs, so each layer also absorbs part of the error its quantized inputs carry in
(as OmniQuant / AutoRound / EfficientQAT's block-wise stage do; they also train rounding or weights,
this trains only the quantization parameters: a per-weight rounding offset learned with Adam
through a straight-through round either moved no code or, at larger rates, made the tiny test
model's layer loss 2.7x worse, so it was not kept).

Cost per layer: `steps` forward + backward passes of one layer over `batch` windows (~40 s per 64
steps for a SmolLM2 layer on the 2-core CPU). Measured on SmolLM2 at g128/64 (experiments/JOURNAL.md
section 8c, perplexity on GPL-3 vs bf16): sequential GPTQ +9.7%; with 64 steps +7.0%; with act-order
and 128 steps +5.7% on 16k calibration tokens and +4.5% on 64k (+7.2% on a second text, the Vim
manual); on 64k of pydoc + GNU info manuals +4.9% (+5.7% on the Vim manual), on 96k of that mix
+6.8% (+6.8%): the calibration sample moves it by ~2 points; with 256 steps on 16k
+7.0% (the extra steps fit the calibration text, not the evaluation text). `RefineConfig.holdout` adds early
stopping on held-out windows. Plain MSE beat a per-token relative error (`per_token=True`: +7.8%).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxserve.config import ModelConfig
from jaxserve.quant import calibration, int4

log = logging.getLogger(__name__)

NORMS = ("attn_norm", "mlp_norm")


@dataclasses.dataclass(frozen=True)
class RefineConfig:
    """steps: Adam steps per layer (0 = no refinement); batch: calibration windows per step;
    lr: Adam learning rate on the relative parameters a, b; norms: also tune the RMSNorm weights.

    holdout: the last `holdout` calibration windows are not trained on: every `eval_every` steps
    the layer's loss on them is measured and the layer keeps the parameters of the step where it
    was lowest (early stopping; step 0 = GPTQ's own values)."""

    steps: int = 64
    batch: int = 4
    lr: float = 3e-3
    norms: bool = True
    per_token: bool = False
    seed: int = 0
    holdout: int = 0
    eval_every: int = 16

    def __post_init__(self):
        if (
            self.steps < 0
            or self.batch < 1
            or not self.lr > 0
            or self.holdout < 0
            or self.eval_every < 1
        ):
            raise ValueError(
                f"refinement needs steps >= 0, batch >= 1, lr > 0, holdout >= 0, eval_every >= 1; "
                f"got steps={self.steps}, batch={self.batch}, lr={self.lr}, "
                f"holdout={self.holdout}, eval_every={self.eval_every}"
            )


def _split(qlp: dict, norms: bool):
    """qlp -> (theta: trainable zeros, fixed: everything the loss needs besides theta)."""
    theta, fixed = {}, {}
    for k, v in qlp.items():
        if isinstance(v, int4.Int4Weight):
            codes, s0, m0 = int4.unpack(v)
            fixed[k] = (codes.astype(jnp.float32), s0.astype(jnp.float32), m0.astype(jnp.float32))
            # Two distinct buffers: `_step` donates theta.
            theta[k] = (jnp.zeros_like(fixed[k][1]), jnp.zeros_like(fixed[k][1]))
        elif norms and k in NORMS:
            fixed[k] = v
            theta[k] = jnp.zeros_like(v)
        else:
            fixed[k] = v
    return theta, fixed


def _params(theta: dict, fixed: dict, group_sizes: dict) -> tuple[dict, dict]:
    """-> (float layer params for `layer_forward`, {name: (scales, mins)} of the int4 linears)."""
    lp, grid = {}, {}
    for k, v in fixed.items():
        if k in group_sizes:
            codes, s0, m0 = v
            a, b = theta[k]
            s, m = s0 * (1.0 + a), m0 + s0 * b
            g = group_sizes[k]
            lp[k] = codes * int4.expand_groups(s, g) + int4.expand_groups(m, g)
            grid[k] = (s, m)
        elif k in theta:
            lp[k] = v * (1.0 + theta[k])
        else:
            lp[k] = v
    return lp, grid


@functools.partial(jax.jit, static_argnames=("config", "group_sizes", "per_token"))
def _loss(theta, fixed, x, y, config: ModelConfig, group_sizes, per_token):
    lp, _ = _params(theta, fixed, dict(group_sizes))
    out, _ = calibration.layer_forward(lp, x, config)
    if per_token:  # each token's error relative to its own size, as the next RMSNorm sees it
        return jnp.mean(jnp.sum(jnp.square(out - y), -1) / jnp.sum(jnp.square(y), -1))
    return jnp.mean(jnp.square(out - y)) / jnp.mean(jnp.square(y))


@functools.partial(
    jax.jit, static_argnames=("config", "group_sizes", "per_token", "opt"), donate_argnums=(0, 1)
)
def _step(theta, opt_state, fixed, x, y, config: ModelConfig, group_sizes, per_token, opt):
    loss, grads = jax.value_and_grad(_loss)(theta, fixed, x, y, config, group_sizes, per_token)
    updates, opt_state = opt.update(grads, opt_state, theta)
    return optax.apply_updates(theta, updates), opt_state, loss


@functools.lru_cache
def _adam(lr: float) -> optax.GradientTransformation:
    return optax.adam(lr)  # one object per lr, so `_step` compiles once per layer shape


def _full_loss(theta, fixed, x, y, config, group_sizes, per_token, batch) -> float:
    tot = 0.0
    for s in range(0, x.shape[0], batch):
        n = min(batch, x.shape[0] - s)
        loss = _loss(theta, fixed, x[s : s + n], y[s : s + n], config, group_sizes, per_token)
        tot += float(loss) * n
    return tot / x.shape[0]


def refine_layer(
    qlp: dict, x: jax.Array, y: jax.Array, config: ModelConfig, rc: RefineConfig
) -> tuple[dict, dict]:
    """Tunes qlp's Int4Weight scales/mins (and norms) so layer(qlp; x) ~ y. x, y f32[N, T, D].

    Returns (new qlp, {"loss_before", "loss_after", "kept"} and, with rc.holdout,
    {"holdout_before", "holdout_after", "best_step"}); the new params are kept only if the loss
    over the training windows (with rc.holdout: over the held-out windows) went down.
    """
    group_sizes = tuple(
        sorted((k, v.group_size) for k, v in qlp.items() if isinstance(v, int4.Int4Weight))
    )
    theta, fixed = _split(qlp, rc.norms)
    h = rc.holdout
    if h >= x.shape[0]:
        raise ValueError(f"holdout={h} leaves no training window of {x.shape[0]}")
    x_ho, y_ho = x[x.shape[0] - h :], y[x.shape[0] - h :]
    x, y = x[: x.shape[0] - h], y[: x.shape[0] - h]
    batch = min(rc.batch, x.shape[0])
    pt = rc.per_token
    before = _full_loss(theta, fixed, x, y, config, group_sizes, pt, batch)
    if rc.steps == 0:
        return qlp, {"loss_before": before, "loss_after": before, "kept": False}
    opt = _adam(rc.lr)
    opt_state = opt.init(theta)
    rng = np.random.default_rng(rc.seed)
    order = np.empty(0, np.int64)
    info: dict = {}
    if h:
        ho_before = _full_loss(theta, fixed, x_ho, y_ho, config, group_sizes, pt, batch)
        best = (ho_before, 0, jax.tree.map(jnp.copy, theta))
    for step in range(1, rc.steps + 1):
        if len(order) < batch:
            order = np.concatenate([order, rng.permutation(x.shape[0])])
        idx, order = order[:batch], order[batch:]
        theta, opt_state, _ = _step(
            theta, opt_state, fixed, x[idx], y[idx], config, group_sizes, pt, opt
        )
        if h and (step % rc.eval_every == 0 or step == rc.steps):
            ho = _full_loss(theta, fixed, x_ho, y_ho, config, group_sizes, pt, batch)
            if ho < best[0]:
                best = (ho, step, jax.tree.map(jnp.copy, theta))
    if h:
        theta = best[2]
        info = {"holdout_before": ho_before, "holdout_after": best[0], "best_step": best[1]}
    after = _full_loss(theta, fixed, x, y, config, group_sizes, pt, batch)
    kept = best[1] > 0 if h else after < before
    info = {"loss_before": before, "loss_after": after, "kept": kept} | info
    if not kept:
        return qlp, info
    _, grid = _params(theta, fixed, dict(group_sizes))
    out = dict(qlp)
    for k, (s, m) in grid.items():
        w = qlp[k]
        out[k] = dataclasses.replace(
            w,
            scales=int4.to_stored(s).astype(w.scales.dtype),
            mins=int4.to_stored(m).astype(w.mins.dtype),
        )
    for k in NORMS:
        if rc.norms and k in theta:
            out[k] = fixed[k] * (1.0 + theta[k])
    return out, info


def sequential_refine(
    params: dict,
    config: ModelConfig,
    tokens: np.ndarray,
    quantize_layer: Callable[[dict, calibration.LayerStats, int], dict],
    rc: RefineConfig,
    batch: int = 4,
) -> tuple[dict, list[dict]]:
    """`calibration.sequential_quantize` plus `refine_layer` after each layer's quantization:
    layer i is quantized on the quantized prefix's outputs x_q and refined towards the float
    model's layer-i output y_f. -> (params, per-layer refinement info)."""
    infos = []

    def refine(qlp, x_q, y_f, i):
        qlp, info = refine_layer(qlp, x_q, y_f, config, rc)
        infos.append(info)
        log.info(
            "refine: layer %d/%d loss %.3e -> %.3e%s%s",
            i + 1,
            config.num_layers,
            info["loss_before"],
            info["loss_after"],
            f"; held out {info['holdout_before']:.3e} -> {info['holdout_after']:.3e} at step "
            f"{info['best_step']}"
            if "best_step" in info
            else "",
            "" if info["kept"] else " (kept GPTQ's)",
        )
        return qlp

    out = calibration.sequential_quantize(
        params, config, tokens, quantize_layer, batch, refine, holdout=rc.holdout
    )
    return out, infos
