"""The INT4 weight pytree (`Int4Weight`) and the quantizer-side packing (`pack`, `to_stored`).

The packed layout itself (eight 4-bit codes per uint32, planes along the output dim; f16 scales
and mins per group of inputs; W = q * scale + min) is defined once, with its diagram, in
`pallas_kernels/int4_layout.py`, beside the kernel that reads it; its names are re-exported here.

    pack(codes, scales, mins, group_size) -> Int4Weight    (checks code range and f16 range)
    unpack(w) -> (codes, scales, mins)
    w.dequantize() -> f32[..., K, N];  w.matmul(x[, layer=l]);  w.take(ids)

Every leaf may carry leading axes (a stacked layer axis [L, ...]). `matmul` needs one layer: a 2-D
weight, or a stack [L, K, N] and the index of the layer (`matmul(x, layer=l)`: the fused kernel
reads that layer in place, so the model's `lax.scan` passes the stack whole). So does
`take(ids)`, the column gather W[:, ids].T that looks up an embedding table stored in the
lm_head view [D, V] (it unpacks only the gathered columns).

The matmul implementation is a static field, `impl`, chosen when the engine is built (the runner
sets it with `jaxserve.quant.with_matmul_impl`: 'pallas' on GPU, 'xla' elsewhere); nothing reads
the backend while tracing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pallas_kernels.int4_layout import (
    GROUP_SIZES,
    PACK,
    STORED_DTYPE,
    check_arrays,
    dequantize_arrays,
    expand_groups,
    pack_codes,
    unpack_codes,
)
from pallas_kernels.int4_matmul import IMPLS, int4_matmul

DEFAULT_GROUP_SIZE = 128
DEFAULT_IMPL = "xla"  # runs on every backend; the engine picks 'pallas' on GPU


@struct.dataclass
class Int4Weight:
    """Packed INT4 weight of logical shape [..., K, N] (layout: `pallas_kernels/int4_layout.py`).

    impl picks the matmul, statically: 'xla' (unpack + dot, the default: runs everywhere),
    'pallas' (the fused kernel, GPU), 'pallas_interpret' (that kernel interpreted, CPU tests) or
    'reference' (f32 jnp). The engine sets it for its backend (`quant.with_matmul_impl`).
    """

    packed: jax.Array  # u32[..., K, N // 8]
    scales: jax.Array  # f16[..., K // group_size, N]
    mins: jax.Array  # f16[..., K // group_size, N]
    group_size: int = struct.field(pytree_node=False, default=DEFAULT_GROUP_SIZE)
    impl: str = struct.field(pytree_node=False, default=DEFAULT_IMPL)

    # `matmul(x, layer=l)` reads layer l of a stack [L, K, N] in place (`layers.linear`)
    reads_layer_in_place = True

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape [..., K, N]."""
        return (*self.packed.shape[:-1], self.packed.shape[-1] * PACK)

    @property
    def ndim(self) -> int:
        return self.packed.ndim

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in self._arrays())

    def _arrays(self):
        return (self.packed, self.scales, self.mins)

    def check(self) -> None:
        """Raises ValueError unless the leaves' shapes and dtypes form a valid packed weight."""
        check_arrays(self.packed, self.scales, self.mins, self.group_size)
        if self.impl not in IMPLS:
            raise ValueError(f"Int4Weight.impl must be one of {IMPLS}, got {self.impl!r}")

    def dequantize(self) -> jax.Array:
        """-> f32[..., K, N]."""
        self.check()
        return dequantize_arrays(self.packed, self.scales, self.mins, self.group_size)

    def take(self, ids: jax.Array, dtype=jnp.float32) -> jax.Array:
        """Columns of W: ids int[...] -> W[:, ids].T [..., K] in dtype, unpacking only those.

        The embedding lookup of a table stored in the lm_head view [D, V] (`layers.embedding`).
        Column n is nibble n // (N/8) of packed[:, n % (N/8)] (see the layout diagram), scaled by
        scales[:, n], mins[:, n]. ids outside [0, N) are clamped.
        """
        self.check()
        if self.packed.ndim != 2:
            raise ValueError(f"Int4Weight.take needs one weight [K, N]; got shape {self.shape}")
        ids = jnp.asarray(ids)
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(f"Int4Weight.take: ids must be integers, got {ids.dtype}")
        k, n8 = self.packed.shape
        flat = jnp.clip(ids.reshape(-1).astype(jnp.int32), 0, n8 * PACK - 1)  # (n,)
        words = jnp.take(self.packed, flat % n8, axis=1)  # (K, n)
        shifts = (4 * (flat // n8)).astype(jnp.uint32)  # (n,) the column's nibble
        codes = ((words >> shifts) & jnp.uint32(0xF)).astype(jnp.float32)  # (K, n)
        s = expand_groups(jnp.take(self.scales, flat, axis=1).astype(jnp.float32), self.group_size)
        m = expand_groups(jnp.take(self.mins, flat, axis=1).astype(jnp.float32), self.group_size)
        cols = codes * s + m  # (K, n)
        return cols.T.reshape(*ids.shape, k).astype(dtype)  # (..., K)

    def matmul(self, x: jax.Array, impl: str | None = None, layer=None) -> jax.Array:
        """x[..., K] @ W[K, N] -> [..., N] in x.dtype (f32 accumulation).

        layer: i32[] or int: the weight is a stack [L, K, N] and W is its layer `layer`.
        """
        self.check()
        if self.packed.ndim != (2 if layer is None else 3):
            raise ValueError(
                f"Int4Weight.matmul needs one layer's weight [K, N], or a stack [L, K, N] with "
                f"layer=; got shape {self.shape} and layer={layer!r}"
            )
        return int4_matmul(
            x,
            self.packed,
            self.scales,
            self.mins,
            group_size=self.group_size,
            impl=impl or self.impl,
            layer=layer,
        )


def to_stored(x: jax.Array) -> jax.Array:
    """Rounds scales/mins to their stored precision (f16), returned as f32."""
    return jnp.asarray(x, jnp.float32).astype(STORED_DTYPE).astype(jnp.float32)


def pack(
    codes: jax.Array,
    scales: jax.Array,
    mins: jax.Array,
    group_size: int = DEFAULT_GROUP_SIZE,
    impl: str = DEFAULT_IMPL,
) -> Int4Weight:
    """codes int[..., K, N] in 0..15, scales/mins f32[..., K/g, N] -> Int4Weight.

    Scales and mins are rounded to float16 (see `to_stored`); values that overflow it raise.
    """
    codes = jnp.asarray(codes)
    if codes.ndim < 2:
        raise ValueError(f"codes must be [..., K, N], got shape {codes.shape}")
    if not jnp.issubdtype(codes.dtype, jnp.integer):
        raise ValueError(f"codes must have an integer dtype, got {codes.dtype}")
    *lead, k, n = codes.shape
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size}")
    if k % group_size:
        raise ValueError(f"input dim K={k} is not a multiple of group_size={group_size}")
    want = (*lead, k // group_size, n)
    for name, a in (("scales", scales), ("mins", mins)):
        if tuple(jnp.shape(a)) != want:
            raise ValueError(
                f"{name} has shape {tuple(jnp.shape(a))}, expected {want} for codes {codes.shape} "
                f"and group_size {group_size}"
            )
    packed, s16, m16, stats = _pack_arrays(codes, jnp.asarray(scales), jnp.asarray(mins))
    if not isinstance(stats, jax.core.Tracer):  # concrete: check values too (one device sync)
        lo, hi, finite_scales, finite_mins = (int(v) for v in np.asarray(stats))
        if lo < 0 or hi > 15:
            raise ValueError(f"INT4 codes must be in 0..15, got range [{lo}, {hi}]")
        for name, ok in (("scales", finite_scales), ("mins", finite_mins)):
            if not ok:
                raise ValueError(f"{name} are not finite in float16 (|value| > 65504 or NaN)")
    w = Int4Weight(packed, s16, m16, group_size=group_size, impl=impl)
    w.check()
    return w


@jax.jit
def _pack_arrays(codes, scales, mins):
    """-> (packed u32, scales f16, mins f16, i32[4] stats: code min, code max, finite scales/mins)."""
    s16, m16 = scales.astype(STORED_DTYPE), mins.astype(STORED_DTYPE)
    stats = jnp.stack(
        [
            jnp.min(codes).astype(jnp.int32),
            jnp.max(codes).astype(jnp.int32),
            jnp.all(jnp.isfinite(s16)).astype(jnp.int32),
            jnp.all(jnp.isfinite(m16)).astype(jnp.int32),
        ]
    )
    return pack_codes(codes), s16, m16, stats


def unpack(w: Int4Weight) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Int4Weight -> (codes u8[..., K, N], scales f32[..., K/g, N], mins f32[..., K/g, N])."""
    w.check()
    return (
        unpack_codes(w.packed),
        w.scales.astype(jnp.float32),
        w.mins.astype(jnp.float32),
    )
