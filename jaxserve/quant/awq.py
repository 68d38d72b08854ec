"""AWQ: activation-aware INT4 quantization (Lin et al. 2023) over calibration statistics.

A linear's output error on calibration inputs X[n, K] is, for a weight error E[K, N],

    ||X E||^2 / n = tr(E^T H E),   H = X^T X / n   f32[K, K]   (from `calibration.LayerStats`)

so every search below is exact for the calibration set and never touches the activations again.

Per decoder layer, for each group of linears sharing one input (the "attn" q/k/v, the "o" wo, the
"mlp" gate/up, the "down" w_down):

  1. scale search: s = a^alpha / sqrt(max * min) with a = mean|x| per input channel, alpha on a grid
     in [0, 1); quantize diag(s) W group-wise (asymmetric, f16 scales/mins) and keep the alpha whose
     diag(1/s) Q(diag(s) W) - W has the least output error (alpha = 0 is plain RTN, so AWQ never
     loses to RTN on the calibration objective). With duo (off by default) the search also tries
     s = a^alpha / m^(1 - alpha), m = `weight_magnitude` (AutoAWQ's duo scaling), for q/k/v,
     gate/up and w_down (wo's scales must stay tied per KV head, so it keeps a^alpha).
  2. fold 1/s into the op that produces the input, so the float network is unchanged:
        attn: attn_norm /= s            mlp:  mlp_norm /= s
        o:    wv (and bv) columns /= s  (s tied across the q heads that share a KV head, since the
              attention output of head h is a convex combination of V rows of KV head h // G)
        down: w_up columns /= s         (silu(gate) * up is linear in up)
  3. clip search (not for wq/wk, as AutoAWQ): per (group, output column) shrink [min, max] by a
     ratio in (0.5, 1], minimizing the group's error e^T H_gg e under the scaled input's H.

Input: f32 layer params from `calibration.layer_slice`. Output: the same dict with the seven linears
replaced by `int4.Int4Weight` and the norm / wv / w_up folds applied.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.quant import calibration, int4

log = logging.getLogger(__name__)

NO_CLIP = ("wq", "wk")  # clipping q/k hurts attention logits more than the linear error shows
DUO = False  # default of `awq_fold`'s duo (see `search_scale`): measured worse on SmolLM2


def quantize_range(wg: jax.Array, lo: jax.Array, hi: jax.Array):
    """Asymmetric grid over [lo, hi] per (group, column). wg f32[G, g, N], lo/hi f32[G, N].

    -> (codes u8[G, g, N], scales f32[G, N], mins f32[G, N]) with scales/mins at stored precision.
    """
    mins = int4.to_stored(lo)
    scales = int4.to_stored(jnp.where(hi > lo, (hi - lo) / 15.0, 1.0))
    q = jnp.round((wg - mins[:, None, :]) / scales[:, None, :])
    return jnp.clip(q, 0, 15).astype(jnp.uint8), scales, mins


def fake_quant(w: jax.Array, group_size: int) -> jax.Array:
    """w f32[K, N] -> dequantized asymmetric RTN f32[K, N]."""
    k, n = w.shape
    wg = w.reshape(k // group_size, group_size, n)
    codes, scales, mins = quantize_range(wg, wg.min(axis=1), wg.max(axis=1))
    return (codes * scales[:, None, :] + mins[:, None, :]).reshape(k, n)


def awq_scales(absmean: jax.Array, alpha, wmag: jax.Array | None = None, beta=0.0) -> jax.Array:
    """Per-input-channel scales s f32[K] = a^alpha / wmag^beta, normalized so
    sqrt(max(s) * min(s)) = 1 (wmag None: a^alpha)."""
    s = jnp.maximum(absmean, 1e-8) ** alpha
    if wmag is not None:
        s = s / jnp.maximum(wmag, 1e-8) ** beta
    s = jnp.maximum(s, 1e-4)
    return s / jnp.sqrt(jnp.max(s) * jnp.min(s))


def weight_magnitude(w: jax.Array, group_size: int) -> jax.Array:
    """w f32[K, N] -> f32[K]: mean over outputs of |w| relative to its group's max |w| (AutoAWQ's
    "duo scaling" weight statistic)."""
    k, n = w.shape
    wg = jnp.abs(w).reshape(k // group_size, group_size, n)
    rel = wg / jnp.maximum(wg.max(axis=1, keepdims=True), 1e-12)
    return rel.reshape(k, n).mean(axis=1)


@functools.partial(jax.jit, static_argnames=("group_size", "n_grid", "duo"))
def search_scale(w, h, absmean, group_size: int, n_grid: int = 20, duo: bool = False):
    """w f32[K, N], h f32[K, K], absmean f32[K] -> (best s f32[K], errors f32[n_grid] per alpha).

    duo: also try s = a^alpha / wmag^(1 - alpha) (`weight_magnitude`) for every alpha and keep the
    best of both families; the returned errors are the a^alpha family's (errors[0] is RTN's).
    """
    alphas = jnp.arange(n_grid, dtype=jnp.float32) / n_grid
    wmag = weight_magnitude(w, group_size)

    def err(s):
        e = fake_quant(w * s[:, None], group_size) / s[:, None] - w  # (K, N)
        return jnp.sum(e * (h @ e))

    errs = jax.lax.map(lambda a: err(awq_scales(absmean, a)), alphas)
    best = awq_scales(absmean, alphas[jnp.argmin(errs)])
    if duo:
        errs_duo = jax.lax.map(lambda a: err(awq_scales(absmean, a, wmag, 1.0 - a)), alphas)
        a_duo = alphas[jnp.argmin(errs_duo)]
        best = jnp.where(
            jnp.min(errs_duo) < jnp.min(errs), awq_scales(absmean, a_duo, wmag, 1.0 - a_duo), best
        )
    return best, errs


@functools.partial(jax.jit, static_argnames=("group_size", "clip", "n_grid"))
def clip_range(w, h, group_size: int, clip: bool = True, n_grid: int = 10):
    """w f32[K, N], h f32[K, K] -> the (lo, hi) f32[K/g, N] of each (group, column)'s grid.

    With clip, each (group, column) range is shrunk by the ratio in {1, 0.95, ..., 0.55} with the
    least error e^T H_gg e on that group's block of H; without, [min, max].
    """
    k, n = w.shape
    g = k // group_size
    wg = w.reshape(g, group_size, n)
    lo0, hi0 = wg.min(axis=1), wg.max(axis=1)  # (G, N)
    if not clip:
        return lo0, hi0
    hb = h.reshape(g, group_size, g, group_size)[jnp.arange(g), :, jnp.arange(g), :]  # (G,g,g)
    ratios = 1.0 - jnp.arange(n_grid, dtype=jnp.float32) * 0.05

    def err(r):
        codes, s, m = quantize_range(wg, r * lo0, r * hi0)
        e = codes * s[:, None, :] + m[:, None, :] - wg  # (G, g, N)
        return jnp.einsum("gab,gan,gbn->gn", hb, e, e)

    errs = jax.lax.map(err, ratios)  # (R, G, N)
    r = ratios[jnp.argmin(errs, axis=0)]  # (G, N)
    return r * lo0, r * hi0


@functools.partial(jax.jit, static_argnames=("group_size", "clip", "n_grid"))
def quantize_clipped(w, h, group_size: int, clip: bool = True, n_grid: int = 10):
    """w f32[K, N], h f32[K, K] -> (codes u8[K, N], scales, mins f32[K/g, N]) on `clip_range`'s grid."""
    k, n = w.shape
    lo, hi = clip_range(w, h, group_size, clip, n_grid)
    codes, scales, mins = quantize_range(w.reshape(k // group_size, group_size, n), lo, hi)
    return codes.reshape(k, n), scales, mins


def _tie_kv(absmean: jax.Array, config: ModelConfig) -> jax.Array:
    """o-input absmean f32[H*Dh] -> the mean over the G heads of each KV head, f32[KVH*Dh]."""
    c = config
    return absmean.reshape(c.num_kv_heads, c.q_per_kv, c.head_dim).mean(axis=1).reshape(-1)


def layer_group_sizes(lp: dict, group_size: int, allow_smaller: bool = False) -> dict[str, int]:
    """The group size of each input ("attn", "o", "mlp", "down") of one layer's linears."""
    return {
        src: calibration.group_size_for(
            f"layers/{names[0]}", lp[names[0]].shape[0], group_size, allow_smaller
        )
        for src, names in calibration.LINEAR_INPUTS.items()
    }


@functools.partial(
    jax.jit, static_argnames=("config", "group_size", "n_grid", "allow_smaller_groups", "duo")
)
def awq_fold(
    lp: dict,
    hessian: dict,
    absmean: dict,
    config: ModelConfig,
    group_size: int,
    n_grid: int = 20,
    allow_smaller_groups: bool = False,
    duo: bool = DUO,
) -> tuple[dict, dict]:
    """Steps 1-2: search each input's scales and fold them. -> (float lp computing the same
    function, with scaled linears; the H of each scaled input, H / (s s^T))."""
    c = config
    lp = dict(lp)
    hs, am = hessian, absmean
    gs = layer_group_sizes(lp, group_size, allow_smaller_groups)
    cat = lambda names: jnp.concatenate([lp[n] for n in names], axis=1)

    w_attn, w_mlp = cat(("wq", "wk", "wv")), cat(("w_gate", "w_up"))
    s_attn, _ = search_scale(w_attn, hs["attn"], am["attn"], gs["attn"], n_grid, duo)
    s_mlp, _ = search_scale(w_mlp, hs["mlp"], am["mlp"], gs["mlp"], n_grid, duo)
    s_down, _ = search_scale(lp["w_down"], hs["down"], am["down"], gs["down"], n_grid, duo)
    # o: search over the KV-tied statistic, then expand each KV channel to its G query heads.
    am_o = jnp.repeat(
        _tie_kv(am["o"], c).reshape(c.num_kv_heads, 1, c.head_dim), c.q_per_kv, axis=1
    ).reshape(-1)
    s_o, _ = search_scale(lp["wo"], hs["o"], am_o, gs["o"], n_grid)
    s_kv = s_o.reshape(c.num_kv_heads, c.q_per_kv, c.head_dim)[:, 0].reshape(-1)  # (KVH*Dh,)

    lp["attn_norm"] = lp["attn_norm"] / s_attn
    for n in ("wq", "wk", "wv"):
        lp[n] = lp[n] * s_attn[:, None]
    lp["wv"] = lp["wv"] / s_kv[None, :]
    if c.attention_bias:
        lp["bv"] = lp["bv"] / s_kv
    lp["wo"] = lp["wo"] * s_o[:, None]
    lp["mlp_norm"] = lp["mlp_norm"] / s_mlp
    for n in ("w_gate", "w_up"):
        lp[n] = lp[n] * s_mlp[:, None]
    lp["w_up"] = lp["w_up"] / s_down[None, :]
    lp["w_down"] = lp["w_down"] * s_down[:, None]

    scaled_h = {
        "attn": hs["attn"] / jnp.outer(s_attn, s_attn),
        "o": hs["o"] / jnp.outer(s_o, s_o),
        "mlp": hs["mlp"] / jnp.outer(s_mlp, s_mlp),
        "down": hs["down"] / jnp.outer(s_down, s_down),
    }
    return lp, scaled_h


@functools.partial(
    jax.jit,
    static_argnames=(
        "config",
        "group_size",
        "n_grid",
        "clip",
        "allow_smaller_groups",
        "duo",
    ),
)
def awq_layer(
    lp: dict,
    hessian: dict,
    absmean: dict,
    config: ModelConfig,
    group_size: int,
    n_grid: int = 20,
    clip: bool = True,
    allow_smaller_groups: bool = False,
    duo: bool = DUO,
) -> dict:
    """One layer's f32 params -> AWQ-scaled, folded and INT4-packed params (see module docstring).

    hessian / absmean: a `calibration.LayerStats`'s fields. One compiled program per layer shape.
    """
    lp, scaled_h = awq_fold(
        lp, hessian, absmean, config, group_size, n_grid, allow_smaller_groups, duo
    )
    gs = layer_group_sizes(lp, group_size, allow_smaller_groups)
    for src, names in calibration.LINEAR_INPUTS.items():
        for n in names:
            codes, scales, mins = quantize_clipped(
                lp[n], scaled_h[src], gs[src], clip and n not in NO_CLIP
            )
            lp[n] = int4.pack(codes, scales, mins, gs[src])
    return lp


def quantize_awq(
    params: dict,
    config: ModelConfig,
    group_size: int,
    calib,
    n_grid: int = 20,
    clip: bool = True,
    allow_smaller_groups: bool = False,
    duo: bool = DUO,
) -> dict:
    """AWQ over every layer. calib: calibration tokens int[N, T] or a list of LayerStats (one per
    layer, from `calibration.collect_stats`, reusable across group sizes).

    Statistics come from the float model (AWQ propagates float activations between layers). An
    untied lm_head (no preceding op to fold a scale into) gets asymmetric RTN.
    """
    if isinstance(calib, np.ndarray | jax.Array):
        calib = calibration.collect_stats(params, config, np.asarray(calib))
    if not isinstance(calib, list | tuple) or len(calib) != config.num_layers:
        raise ValueError(
            "calib must be calibration tokens int[N, T] or one LayerStats per layer "
            f"({config.num_layers}), got {type(calib).__name__}"
        )
    layers = []
    for i, st in enumerate(calib):
        lp = calibration.layer_slice(params, i)
        layers.append(
            awq_layer(
                lp,
                st.hessian,
                st.absmean,
                config,
                group_size,
                n_grid,
                clip,
                allow_smaller_groups,
                duo,
            )
        )
        log.info("awq: layer %d/%d", i + 1, config.num_layers)
    return calibration.quantize_lm_head(
        calibration.restack(params, layers), config, group_size, allow_smaller_groups
    )
