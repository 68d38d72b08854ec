"""Each slot's token history, `SlotState.history` i32[S, L] (L = max_model_len): every token of
the slot's sequence at its position, prompt and output, which the n-gram proposer of
`spec_decode.py` searches. Kept only when the engine speculates; otherwise the field is None and
both functions return None (no leaf, no work). Jittable; device code only.

    set_row(history, slot, row)                        a request's prompt + outputs into its slot
    append(history, rows, positions, tokens, keep)     new tokens at their positions
"""

from __future__ import annotations

import jax.numpy as jnp


def set_row(history, slot, row):
    """`history` with slot `slot` holding the row's prompt then its output tokens (-1 padded);
    None when no history is kept."""
    if history is None:
        return None
    n = history.shape[1]
    prompt = jnp.asarray(row.prompt_tokens, jnp.int32)[:n]
    output = jnp.asarray(row.output_tokens, jnp.int32)[:n]
    p = jnp.sum(prompt >= 0)
    i = jnp.arange(n)
    tokens = jnp.where(i < p, prompt, output[jnp.clip(i - p, 0, n - 1)])
    return history.at[slot].set(tokens)


def append(history, rows, positions, tokens, keep):
    """history[rows[i], positions[i]] = tokens[i] where keep[i] (None without a history)."""
    if history is None:
        return None
    rows = jnp.where(keep, rows, history.shape[0])  # out of range: dropped
    return history.at[rows, positions].set(tokens, mode="drop")
