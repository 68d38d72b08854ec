"""LoRA on the device: every adapter slot's weights stacked, and each row's own adapter product.

    params["lora"][name] = {"a": [L, in, N, R], "b": [L, N, R, out]}   N = max_loras slots,
                                                                        R = max_lora_rank
    rows i32[B]: each batch row's slot (-1: no adapter)

    delta(x, a, b, rows) = sum over slots n of [rows == n] * (x @ a[n]) @ b[n]      [B, T, out]

computed as two dense products over all slots at once (shrink: x [B*T, in] @ a as [in, N*R];
mask each row's other slots' columns to zero; expand: [B*T, N*R] @ b as [N*R, out]). The
layouts make both views free reshapes of one layer's slice, so no GEMM reads a transposed copy. Shapes are
fixed by (N, R), so loading, evicting or mixing adapters never recompiles; no sort, gather or
per-adapter loop; a row's result depends on its own slot only. Its cost is every slot's weights
read once per step, N * R * (in + out) per weight: with N = 4, R = 16 on Llama-3-8B about 3% of
the base weights' bytes. A grouped form (rows sorted by slot, `lax.ragged_dot`: Punica's SGMV)
reads only the batch's adapters; which is faster per backend is measured, not assumed
(experiments/JOURNAL.md 56a-56b).

A rank below R is zero-padded, scale = alpha / r (rsLoRA: alpha / sqrt(r)) is folded into b, and a
weight the adapter leaves alone is zeros (`lora/peft.py`). The layer axis comes first: the
layer scan hands each layer its slice, like any scanned weight.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.lora.peft import LoRAAdapter, target_dims


def init(config: ModelConfig, max_loras: int, max_rank: int, dtype) -> dict:
    """Zeros for every slot: {name: {"a": [L, in, N, R], "b": [L, N, R, out]}}."""
    L = config.num_layers
    return {
        name: {
            "a": jnp.zeros((L, d_in, max_loras, max_rank), dtype),
            "b": jnp.zeros((L, max_loras, max_rank, d_out), dtype),
        }
        for name, (d_in, d_out) in target_dims(config).items()
    }


def slot_arrays(adapter: LoRAAdapter | None, config: ModelConfig, max_rank: int, dtype) -> dict:
    """One slot's weights as host arrays of `init`'s per-slot shapes ([L, in, R], [L, R, out]):
    the adapter's, zero-padded to max_rank (zeros everywhere for None)."""

    L = config.num_layers
    out = {}
    for name, (d_in, d_out) in target_dims(config).items():
        a = np.zeros((L, d_in, max_rank), np.float32)
        b = np.zeros((L, max_rank, d_out), np.float32)
        if adapter is not None and name in adapter.weights:
            wa, wb = adapter.weights[name]
            a[:, :, : wa.shape[-1]] = wa
            b[:, : wb.shape[1]] = wb
        out[name] = {"a": a.astype(dtype), "b": b.astype(dtype)}
    return out


def set_slot(lora: dict, slot, weights: dict) -> dict:
    """`lora` with slot `slot` (i32[]) holding `weights` (`slot_arrays`); donate `lora`."""
    return {
        name: {
            "a": s["a"].at[:, :, slot].set(w["a"].astype(s["a"].dtype)),
            "b": s["b"].at[:, slot].set(w["b"].astype(s["b"].dtype)),
        }
        for name, s, w in ((n, lora[n], weights[n]) for n in lora)
    }


def get_slot(lora: dict, slot: int) -> dict:
    """Slot `slot`'s weights as host f32 arrays of `slot_arrays`' shapes."""
    return {
        name: {
            "a": np.asarray(w["a"][:, :, slot], np.float32),
            "b": np.asarray(w["b"][:, slot], np.float32),
        }
        for name, w in lora.items()
    }


def delta(x: jax.Array, a: jax.Array, b: jax.Array, rows: jax.Array) -> jax.Array:
    """x [B, T, in] -> the adapters' addition [B, T, out] in x.dtype (see the module docstring).

    a [in, N, R], b [N, R, out] (one layer's slots); rows i32[B] (-1 = none)."""
    bsz, t, d_in = x.shape
    _, n, r = a.shape
    h = jnp.dot(x.reshape(bsz * t, d_in), a.reshape(d_in, n * r).astype(x.dtype))
    mine = rows[:, None] == jnp.arange(n, dtype=rows.dtype)[None, :]  # (B, N)
    mask = jnp.repeat(jnp.repeat(mine, t, axis=0), r, axis=1)  # (B*T, N*R)
    h = jnp.where(mask, h, jnp.zeros((), h.dtype))
    y = jnp.dot(h, b.reshape(n * r, -1).astype(x.dtype))
    return y.reshape(bsz, t, -1)
