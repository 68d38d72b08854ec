"""GPTQ: INT4 quantization with Hessian-based error compensation (Frantar et al. 2022).

For a linear W[K, N] (`[in, out]`) with calibration inputs X[n, K], GPTQ quantizes the K input rows
one at a time and spreads each row's rounding error over the rows not yet quantized, so as to
minimize ||X (W - Q)||^2 = tr((W - Q)^T H (W - Q)) with H = X^T X / n (`calibration.LayerStats`):

    H += damp * mean(diag H) * I                   (dead inputs, diag 0, get H_ii = 1 and W_i = 0)
    U = chol(H^-1)^T          upper triangular, H^-1 = U^T U   [K, K] (f64 factorization, f32 use)
    for each block of B = 128 rows (lazy batch updates):
        for row r in the block:
            at a group start (r % g == 0): scale, min of that group from the CURRENT rows r..r+g-1
            q_r = clip(round((w_r - min) / scale), 0, 15);  err = (w_r - deq(q_r)) / U[r, r]
            rows r+1.. of the block -= U[r, r+1:] (x) err
        rows after the block -= U[block, after]^T @ errs
    -> codes u8[K, N], scales, mins f32[K/g, N] (asymmetric, f16-rounded: the packed layout's grid)

Act-order (`act_order=True`) processes rows by decreasing diag(H), the most active inputs first.
Choosing group parameters as groups are *reached* in that order would make a group a scattered set
of rows, which the packed layout (contiguous groups along K) cannot express without an index array.
So with act-order the group parameters are fixed up front from the original W over the contiguous
groups ("static groups", as AutoGPTQ's static_groups=True); rows are then quantized in act order
against their own contiguous group's grid, and the codes are un-permuted back to natural row order.
The packed layout is unchanged.

Default recipe (`quantize_gptq`): AWQ's scale search and fold first (`awq.awq_fold`: the scaled
weights are easier to quantize and the folds keep the float network unchanged), then GPTQ on the
scaled weights with the scaled inputs' H and a large dampening (DEFAULT_DAMP, see there). Optional
clip search (`clip=True`): each group's [min, max] is shrunk by the ratio with the least
e^T H_gg e on its current rows, as AWQ's clip search.

Statistics: given calibration tokens, each layer is quantized on inputs that went through the
already-quantized layers before it (`calibration.sequential_quantize`, two layer passes each);
given precomputed float-model `LayerStats` (one pass, shared with AWQ and across group sizes), on
the float model's inputs. q/k/v share one run (same input, columns are independent), as do gate/up.
"""

from __future__ import annotations

import logging

import jax
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.quant import awq, calibration, refine

log = logging.getLogger(__name__)

BLOCK = 128  # lazy-update block; a multiple of every supported group size
# Dampening as a fraction of mean(diag H), far above the paper's 0.01. H of SmolLM2's w_down is
# dominated by a few tokens with massive activations (the attention sink at position 0: 82% of
# tr(H) in layer 28), so the undamped objective is mostly those tokens' error, and compensating
# for it costs every other token. A large damp adds a plain weight-error term (damp * mean(diag H)
# * ||E||^2) that keeps the compensation modest. Measured on SmolLM2 at g128/64 (float-model
# statistics, 32x512 pydoc tokens; perplexity on GPL-3, bf16 24.90): GPTQ alone 32.51 at 0.01,
# 31.32 at 0.1; on AWQ scales 28.04 at 0.1, 27.39 at 0.5, 27.21 at 1.0 (AWQ alone 28.20).
# The same trend held with statistics of the evaluation text itself (GPTQ at 0.1: 32.70), so it
# is not overfitting to the calibration text's domain.
DEFAULT_DAMP = 1.0


def _stored(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def _group_params(rows: np.ndarray, hb: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """rows f32[g, N] -> (scale, min) f32[N] of the asymmetric grid over [min, max] (f16-rounded).

    With hb f32[g, g] (the group's diagonal block of H), the range is AWQ's clip search
    (`awq.clip_range`: each column's [min, max] shrunk by the ratio with the least e^T hb e).
    """
    if hb is None:
        lo, hi = rows.min(axis=0), rows.max(axis=0)
    else:
        lo, hi = map(np.asarray, awq.clip_range(rows, hb.astype(np.float32), rows.shape[0]))
    return _stored(np.where(hi > lo, (hi - lo) / 15.0, 1.0)), _stored(lo)


def gptq_matrix(
    w: np.ndarray,
    h: np.ndarray,
    group_size: int,
    act_order: bool = False,
    damp: float = DEFAULT_DAMP,
    clip: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w f32[K, N], h f32[K, K] -> (codes u8[K, N], scales f32[K/g, N], mins f32[K/g, N]).

    clip: choose each group's grid by `_group_params`' clip search on H's diagonal block.
    """
    k, n = w.shape
    if h.shape != (k, k):
        raise ValueError(f"hessian has shape {h.shape}, expected {(k, k)} for weight {w.shape}")
    if k % group_size:
        raise ValueError(f"input dim K={k} is not a multiple of group_size={group_size}")
    if not damp > 0:
        raise ValueError(f"damp must be > 0, got {damp}")
    W = np.array(w, np.float32)
    H = np.array(h, np.float64)
    dead = np.diag(H) == 0
    H[dead, dead] = 1.0
    W[dead] = 0.0
    n_groups = k // group_size
    H0 = H.copy() if clip else None  # natural order, undamped

    def hblock(gi: int) -> np.ndarray | None:
        """Group gi's diagonal block of the undamped H (None without clip search)."""
        if not clip:
            return None
        sl = slice(gi * group_size, (gi + 1) * group_size)
        return H0[sl, sl]

    scales = np.zeros((n_groups, n), np.float32)
    mins = np.zeros((n_groups, n), np.float32)
    if act_order:
        perm = np.argsort(-np.diag(H), kind="stable")
        for gi in range(n_groups):  # static groups from the original W (see module docstring)
            scales[gi], mins[gi] = _group_params(
                W[gi * group_size : (gi + 1) * group_size], hblock(gi)
            )
        W, H = W[perm], H[perm][:, perm]
    else:
        perm = np.arange(k)
    H[np.diag_indices(k)] += damp * np.mean(np.diag(H))  # (K, K)
    U = np.linalg.cholesky(np.linalg.inv(H)).T.astype(np.float32)  # H^-1 = U^T U
    codes = np.zeros((k, n), np.uint8)
    for i1 in range(0, k, BLOCK):
        i2 = min(i1 + BLOCK, k)
        W1 = W[i1:i2].copy()
        E1 = np.zeros_like(W1)
        for i in range(i2 - i1):
            r = i1 + i
            if not act_order and r % group_size == 0:
                scales[r // group_size], mins[r // group_size] = _group_params(
                    W1[i : i + group_size], hblock(r // group_size)
                )
            gi = perm[r] // group_size
            q = np.clip(np.round((W1[i] - mins[gi]) / scales[gi]), 0, 15)
            codes[r] = q
            err = (W1[i] - (q * scales[gi] + mins[gi])) / U[r, r]
            W1[i + 1 :] -= np.outer(U[r, r + 1 : i2], err)
            E1[i] = err
        W[i2:] -= U[i1:i2, i2:].T @ E1
    out = np.empty_like(codes)
    out[perm] = codes
    return out, scales, mins


def _split_pack(codes, scales, mins, widths, group_size):
    """Column-concatenated GPTQ result -> one Int4Weight per original weight."""
    out, start = [], 0
    for wd in widths:
        sl = slice(start, start + wd)
        out.append(calibration.pack_int4(codes[:, sl], scales[:, sl], mins[:, sl], group_size))
        start += wd
    return out


def gptq_layer(
    lp: dict,
    stats: calibration.LayerStats,
    group_size: int,
    act_order: bool = False,
    damp: float = DEFAULT_DAMP,
    allow_smaller_groups: bool = False,
    clip: bool = False,
) -> dict:
    """One layer's f32 params -> params with its seven linears as GPTQ Int4Weight."""
    lp = dict(lp)
    for src, names in calibration.LINEAR_INPUTS.items():
        ws = [np.asarray(lp[n], np.float32) for n in names]
        g = calibration.group_size_for(
            f"layers/{names[0]}", ws[0].shape[0], group_size, allow_smaller_groups
        )
        codes, scales, mins = gptq_matrix(
            np.concatenate(ws, axis=1), stats.hessian[src], g, act_order, damp, clip
        )
        lp.update(zip(names, _split_pack(codes, scales, mins, [w.shape[1] for w in ws], g)))
    return lp


def quantize_gptq(
    params: dict,
    config: ModelConfig,
    group_size: int,
    calib,
    act_order: bool = False,
    damp: float = DEFAULT_DAMP,
    allow_smaller_groups: bool = False,
    awq_scales: bool = True,
    clip: bool = False,
    refine_config: refine.RefineConfig | None = None,
) -> dict:
    """GPTQ over every layer. calib: calibration tokens int[N, T] (layers quantized sequentially,
    each on the outputs of the quantized layers before it), or a list of LayerStats from
    `calibration.collect_stats` (float-model statistics, shared with AWQ and across group sizes).

    awq_scales (default): first apply AWQ's activation-aware scales (`awq.awq_fold`), then run GPTQ
    on the scaled weights with the scaled inputs' H (the default recipe: on SmolLM2 g128/64 this
    beats both AWQ and GPTQ alone; see DEFAULT_DAMP). clip: `gptq_matrix`'s clip search (off: on
    SmolLM2 it gained 0.07 perplexity for 4x the time). refine_config (needs calibration tokens):
    after each layer's GPTQ, tune its group scales/mins and norms towards the float layer's output
    (`refine.sequential_refine`). An untied lm_head gets asymmetric RTN.
    """

    def quantize_layer(lp, stats, i):
        if awq_scales:
            lp, h = awq.awq_fold(
                lp,
                stats.hessian,
                stats.absmean,
                config,
                group_size,
                allow_smaller_groups=allow_smaller_groups,
            )
            stats = calibration.LayerStats({k: np.asarray(v) for k, v in h.items()}, {}, 0)
        return gptq_layer(lp, stats, group_size, act_order, damp, allow_smaller_groups, clip)

    is_tokens = isinstance(calib, np.ndarray | jax.Array) and np.ndim(calib) == 2
    if refine_config is not None and refine_config.steps > 0:
        if not is_tokens:
            raise ValueError("GPTQ refinement needs calibration tokens int[N, T], not statistics")
        params, _ = refine.sequential_refine(
            params, config, np.asarray(calib), quantize_layer, refine_config
        )
    elif isinstance(calib, list | tuple) and len(calib) == config.num_layers:
        layers = []
        for i, st in enumerate(calib):
            layers.append(quantize_layer(calibration.layer_slice(params, i), st, i))
            log.info("gptq: layer %d/%d", i + 1, config.num_layers)
        params = calibration.restack(params, layers)
    elif is_tokens:
        params = calibration.sequential_quantize(params, config, np.asarray(calib), quantize_layer)
    else:
        raise ValueError(
            "calib for GPTQ must be calibration tokens int[N, T] or one LayerStats per layer "
            f"({config.num_layers}), got {type(calib).__name__}"
        )
    return calibration.quantize_lm_head(params, config, group_size, allow_smaller_groups)
