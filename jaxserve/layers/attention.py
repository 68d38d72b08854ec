"""Paged attention dispatch: the model calls `attention`, which picks a Pallas kernel, the ragged
XLA decode path (CPU) or the jnp reference.

The metadata pytree is built by the runner once per step and passed explicitly through the model
(no hidden global context). Shapes are fixed per compiled step; padding rows/tokens are marked by
seq_lens == 0 and slot_mapping == -1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxserve.layers.kv_cache import KVCache
from jaxserve.layers.ragged_attention import ragged_decode_attention
from pallas_kernels import paged_attention as pa
from pallas_kernels import paged_prefill as pp


@struct.dataclass
class AttentionMetadata:
    positions: jax.Array  # i32[B, T]   absolute position of each new token
    slot_mapping: jax.Array  # i32[B, T]   flat KV slot of each new token, -1 = padding
    page_table: jax.Array  # i32[B, W]   pages of each row's sequence (W = pages visible this step)
    seq_lens: jax.Array  # i32[B]      KV length after this step's writes, 0 = inactive row
    # Static: flat live-page bucket of a decode step for the 'ragged' impl (0 = not used).
    num_flat_pages: int = struct.field(pytree_node=False, default=0)

    @classmethod
    def contiguous(cls, lens, length: int, page_size: int) -> AttentionMetadata:
        """Rows b = 0..B-1 of `length` tokens from position 0, row b in its own pages
        b * P .. (b + 1) * P - 1 (P = ceil(length / page_size)); lens i32[B] valid tokens per row
        (the rest are padding: slot -1). The layout of a whole-window forward (perplexity,
        calibration-style experiments, model tests) over a cache of B * P pages."""
        lens = np.asarray(lens, np.int32)
        b, p = len(lens), -(-length // page_size)
        table = np.arange(b * p, dtype=np.int32).reshape(b, p)  # (B, P)
        t = np.arange(length, dtype=np.int32)
        slots = table[:, t // page_size] * page_size + t % page_size  # (B, T)
        return cls(
            positions=jnp.asarray(np.broadcast_to(t, (b, length))),
            slot_mapping=jnp.asarray(np.where(t[None, :] < lens[:, None], slots, -1)),
            page_table=jnp.asarray(table),
            seq_lens=jnp.asarray(lens),
        )


def attention(
    q: jax.Array, cache: KVCache, layer: jax.Array, meta: AttentionMetadata, impl: str
) -> jax.Array:
    """q: [B, T, H, D] -> [B, T, H, D]. The new tokens' K/V must already be written to `cache`.

    impl (static) is resolved when the engine is built (`jaxserve.resolve`), never here:

    'pallas' / 'pallas_interpret': T == 1 runs the flash-decoding kernel, T > 1 the ragged
    chunked-prefill kernel; both read the whole stacked pool at the traced `layer`.
    'ragged' (XLA, the CPU default): decode over the step's live pages laid end to end
    (`ragged_attention.py`, needs meta.num_flat_pages); prefill chunks use the reference.
    """
    if impl == "ragged":
        if q.shape[1] == 1 and meta.num_flat_pages > 0:
            kv_len = jnp.minimum(meta.seq_lens, meta.positions[:, 0] + 1)
            out = ragged_decode_attention(
                q[:, 0],
                cache.k,
                cache.v,
                jnp.maximum(kv_len, 0),
                meta.page_table,
                meta.num_flat_pages,
                layer,
                cache.k_scale,
                cache.v_scale,
            )
            return out[:, None]  # (B, 1, H, D)
        impl = "reference"
    if impl in ("pallas", "pallas_interpret"):
        interpret = impl == "pallas_interpret"
        if q.shape[1] == 1:
            # Decode sees keys s <= position and s < seq_len: one visible length per row.
            kv_len = jnp.minimum(meta.seq_lens, meta.positions[:, 0] + 1)
            out = pa.paged_attention(
                q[:, 0],
                cache.k,
                cache.v,
                jnp.maximum(kv_len, 0),
                meta.page_table,
                layer,
                cache.k_scale,
                cache.v_scale,
                interpret=interpret,
            )
            return out[:, None]  # (B, 1, H, D)
        return pp.paged_prefill_attention(
            q,
            cache.k,
            cache.v,
            meta.positions,
            meta.seq_lens,
            meta.page_table,
            layer,
            cache.k_scale,
            cache.v_scale,
            interpret=interpret,
        )
    if impl == "reference":
        return pa.paged_attention_reference(
            q,
            cache.k,
            cache.v,
            meta.positions,
            meta.seq_lens,
            meta.page_table,
            layer,
            cache.k_scale,
            cache.v_scale,
        )
    raise ValueError(f"attention impl {impl!r} is not available")
