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

from cpu_kernels import paged_decode_attention as cpu_attention
from jaxserve.layers.kv_cache import KVCache
from pallas_kernels.attention import mgpu_decode, mgpu_prefill, triton_decode, triton_prefill
from pallas_kernels.attention.paged_kv import PagedKV
from pallas_kernels.attention.reference import prefill_reference
from pallas_kernels.attention.xla import prefill_attention, ragged_decode_attention
from pallas_kernels.mgpu_common import accepts


@struct.dataclass
class AttentionMetadata:
    positions: jax.Array  # i32[B, T]   absolute position of each new token
    slot_mapping: jax.Array  # i32[B, T]   flat KV slot of each new token, -1 = padding
    page_table: jax.Array  # i32[B, W]   pages of each row's sequence (W = pages visible this step)
    seq_lens: jax.Array  # i32[B]      KV length after this step's writes, 0 = inactive row
    # Static: flat live-page bucket of a decode step for the 'ragged' impl (0 = not used).
    num_flat_pages: int = struct.field(pytree_node=False, default=0)
    # Static: the same for a sliding-window layer (each row's pages from its window's first one:
    # at most ceil(window / page_size) + 1), so its cost follows the window; 0 = num_flat_pages.
    num_window_flat_pages: int = struct.field(pytree_node=False, default=0)

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
    q: jax.Array,
    cache: KVCache,
    layer: jax.Array,
    meta: AttentionMetadata,
    impl: str,
    *,
    window=None,
    softcap: float | None = None,
    scale: float | None = None,
) -> jax.Array:
    """q: [B, T, H, D] -> [B, T, H, D]. The new tokens' K/V must already be written to `cache`.

    window: i32[] (traced: the layer's sliding window, scanned with the layers) or None; a key at
    position p is visible to a query at position t iff 0 <= t - p < window; window <= 0 = global.
    softcap (static): Gemma-2 logit soft-capping, s -> softcap * tanh(s / softcap); None = off.
    scale (static): the logits' scale; None = 1 / sqrt(D).

    Under a mesh whose 'model' axis has T > 1 devices (tensor parallelism, `jaxserve.parallel`),
    the heads are split over it: every device attends its H/T query heads over its KVH/T KV heads
    of the pool (`jax.shard_map`), so the kernels stay single-device.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if "model" in mesh.axis_names and mesh.shape["model"] > 1:
        return _sharded_attention(q, cache, layer, meta, impl, window, softcap, scale)
    return _attention_local(q, cache, layer, meta, impl, window, softcap, scale)


def _decode_kv_len(meta: AttentionMetadata) -> jax.Array:
    """i32[B]: the keys a decode row's query sees, s <= position and s < seq_len (0: none)."""
    return jnp.maximum(jnp.minimum(meta.seq_lens, meta.positions[:, 0] + 1), 0)


def _sharded_attention(q, cache, layer, meta, impl, window, softcap, scale):
    """`_attention_local` per device over the 'model' axis: q's heads (axis 2) and the pool's KV
    heads (axis 1) sharded, everything else replicated."""
    P = jax.sharding.PartitionSpec
    heads = P(None, None, "model", None)
    pool = P(None, "model")
    kv = KVCache(
        k=pool,
        v=pool,
        k_scale=pool if cache.quantized else None,
        v_scale=pool if cache.quantized else None,
    )
    has_window = window is not None

    def local(q, cache, layer, meta, window):
        return _attention_local(
            q, cache, layer, meta, impl, window if has_window else None, softcap, scale
        )

    return jax.shard_map(
        local,
        in_specs=(heads, kv, P(), P(), P()),
        out_specs=heads,
        axis_names={"model"},
        check_vma=False,
    )(q, cache, layer, meta, window if has_window else jnp.int32(0))


def _attention_local(q, cache, layer, meta, impl, window, softcap, scale):
    """`attention` on one device (every head of q and of the pool is local).

    impl (static) is resolved when the engine is built (`jaxserve.resolve`), never here:

    'pallas' / 'pallas_interpret': T == 1 runs the flash-decoding kernel, T > 1 the ragged
    chunked-prefill kernel; both read the whole stacked pool at the traced `layer`, and a
    windowed layer's loop starts at its window's first page.
    'mgpu' / 'mgpu_interpret': the Mosaic GPU kernels (Hopper: TMA + wgmma): T == 1 the decode
    kernel (`pallas_kernels/attention/mgpu_decode.py`), T > 1 the prefill kernel
    (`mgpu_prefill.py`); where one refuses the call (f32 queries, a head dim other than
    64 / 128 / 256, pages under 8 tokens: `check_mgpu_decode`, `check_mgpu_prefill`), its Triton
    twin as 'pallas'.
    'cpu_kernel' (the CPU default where it builds): the C++ kernel of
    `cpu_kernels/paged_decode_attention.py`, which reads each row's pages of the whole pool at
    the traced `layer` in place; a prefill chunk's tokens run as decode rows at their positions
    (only the keys each one sees, the bits a decode step would give it).
    'ragged' (XLA): decode over the step's live pages laid end to end
    (`pallas_kernels/attention/xla.py`, needs meta.num_flat_pages); prefill chunks take its
    `prefill_attention`, the reference laid out for the CPU's dots.

    window / softcap / scale go to every path unchanged (see `attention`). Decode paths take the
    query at kv_len - 1, which is the decode step's position (seq_len = position + 1).
    """
    opts = dict(window=window, softcap=softcap, scale=scale)
    decode = q.shape[1] == 1
    # every form's arguments, in the family's one order: the query, the pool at this layer, what
    # each row sees (a decode row: its kv_len; a chunk: its positions and lengths), its pages
    kv = PagedKV(cache.k, cache.v, cache.k_scale, cache.v_scale, layer)
    decode_args = (q[:, 0], kv, _decode_kv_len(meta), meta.page_table)
    chunk_args = (q, kv, meta.positions, meta.seq_lens, meta.page_table)
    if impl == "cpu_kernel":
        if decode:
            return cpu_attention.paged_decode_attention(*decode_args, **opts)[:, None]
        return cpu_attention.paged_prefill_attention(*chunk_args, **opts)
    if impl == "ragged":
        if decode and meta.num_flat_pages > 0:

            def ragged(num_flat):
                return ragged_decode_attention(*decode_args, num_flat, **opts)

            small = meta.num_window_flat_pages
            if window is None or not 0 < small < meta.num_flat_pages:
                return ragged(meta.num_flat_pages)[:, None]  # (B, 1, H, D)
            # a sliding layer gathers only its window's pages; a global one every live page
            out = jax.lax.cond(
                window > 0, lambda: ragged(small), lambda: ragged(meta.num_flat_pages)
            )
            return out[:, None]
        if not decode:
            return prefill_attention(*chunk_args, **opts)
        impl = "reference"
    if impl in ("mgpu", "mgpu_interpret"):
        interpret = impl == "mgpu_interpret"
        if decode and accepts(mgpu_decode.check_mgpu_decode, q[:, 0], kv):
            out = mgpu_decode.paged_attention_mgpu(*decode_args, **opts, interpret=interpret)
            return out[:, None]  # (B, 1, H, D)
        if not decode and accepts(mgpu_prefill.check_mgpu_prefill, q, kv):
            return mgpu_prefill.paged_prefill_mgpu(*chunk_args, **opts, interpret=interpret)
    if impl in ("pallas", "pallas_interpret", "mgpu", "mgpu_interpret"):
        interpret = impl in ("pallas_interpret", "mgpu_interpret")
        if decode:
            out = triton_decode.paged_attention(*decode_args, **opts, interpret=interpret)
            return out[:, None]  # (B, 1, H, D)
        return triton_prefill.paged_prefill_attention(*chunk_args, **opts, interpret=interpret)
    if impl == "reference":
        return prefill_reference(*chunk_args, **opts)
    raise ValueError(f"attention impl {impl!r} is not available")
