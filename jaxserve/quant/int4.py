"""The ONE packed INT4 weight layout: eight 4-bit codes per uint32, planes along the output dim.

A linear weight W[K, N] (`[in, out]`, x @ W) is stored as codes q in 0..15 with one scale and one
min per group of `group_size` consecutive inputs (rows) and output column:

    W[k, n] = q[k, n] * scales[k // g, n] + mins[k // g, n]

That covers symmetric RTN (min = -8 * scale), asymmetric RTN/AWQ/GPTQ (min = -zero * scale) and
GGUF Q4_1 exactly (w = d * q + m, g = 32). Q4_0 (w = d * (q - 8)) is the symmetric case.

Packing: the N output columns are cut into eight planes of N/8 columns; nibble j (bits 4j..4j+3) of
packed[k, c] holds the code of column j * N/8 + c:

                   c = 0 ........................ N/8-1
    packed[k, :]  [ u32 | u32 | u32 | ...           | u32 ]      u32[K, N/8]
                     |
                     bits 31..28  27..24 ...   7..4    3..0
                     nibble  7       6   ...     1       0
                             |       |           |       |
    W[k, :] = [ plane 0: cols 0..N/8-1 | plane 1: N/8..2N/8-1 | ... | plane 7: 7N/8..N-1 ]
                 (nibble 0 of every c)   (nibble 1 of every c)         (nibble 7)

    scales, mins: f16[K/g, N]   (group axis along the INPUT dim, full N; not packed)

so `unpack_codes` is a shift/mask into [K, 8, N/8] followed by a free reshape to [K, N].

Why eight per uint32 in planes along N (not two per uint8, not interleaved, not along K):
  * the fused kernel loads one u32 tile [bk, bc] and gets eight [bk, bc] code tiles with one shift
    and mask each, each multiplying the SAME activation tile x[:, k-block] into the output columns
    of its plane. Nibbles interleaved along a tile axis (two per u8 along K, as many kernels do)
    need an in-register join/reshape/transpose to un-interleave, which Triton turns into layout
    conversions through shared memory; planes need none. Packing along N keeps the group axis
    (K) whole, so a group's scales are a plain row slice [1, bc] applied after the dot:
        x_g @ W_g = scales_g * (x_g @ q_g) + mins_g * sum_k x_g;
  * u8 would give two planes per byte and the same bytes; u32 gives eight planes from one 2-D
    block load with no byte-level indexing, and shifts are native 32-bit integer ops;
  * the XLA/CPU path unpacks with one broadcasted shift and a reshape.
The cost: N must be a multiple of 8 (true of every real model's projections).

Scales and mins are stored as float16: GGUF's own precision (so Q4_1/Q4_0 import is exact) and at
g=128 the INT4 weight is (0.5 + 4/128) bytes per value = 0.266x of bf16. Quantizers must compute
codes against the stored scales: round with `to_stored(scales)` first (RTN in `rtn.py` does).

Every leaf may carry leading axes (a stacked layer axis [L, ...]). `matmul` needs one layer: a 2-D
weight, or a stack [L, K, N] and the index of the layer (`matmul(x, layer=l)`: the fused kernel
reads that layer in place, so the model's `lax.scan` passes the stack whole). So does
`take(ids)`, the column gather W[:, ids].T that looks up an embedding table stored in the
lm_head view [D, V] (it unpacks only the gathered columns).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 128
PACK = 8  # codes per uint32
STORED_DTYPE = jnp.float16  # scales and mins
IMPLS = ("auto", "xla", "pallas", "pallas_interpret", "reference")


@struct.dataclass
class Int4Weight:
    """Packed INT4 weight of logical shape [..., K, N] (see the module docstring for the layout).

    impl picks the matmul: 'auto' = the fused Pallas kernel on GPU, the XLA unpack + dot elsewhere;
    'xla', 'pallas', 'pallas_interpret' (CPU tests) and 'reference' force one.
    """

    packed: jax.Array  # u32[..., K, N // 8]
    scales: jax.Array  # f16[..., K // group_size, N]
    mins: jax.Array  # f16[..., K // group_size, N]
    group_size: int = struct.field(pytree_node=False, default=DEFAULT_GROUP_SIZE)
    impl: str = struct.field(pytree_node=False, default="auto")

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
        from pallas_kernels.int4_matmul import int4_matmul  # the kernel imports this module

        return int4_matmul(
            x,
            self.packed,
            self.scales,
            self.mins,
            group_size=self.group_size,
            impl=impl or self.impl,
            layer=layer,
        )


def check_arrays(packed, scales, mins, group_size: int) -> None:
    """Shape/dtype checks of a packed weight's arrays (shapes are static, so this is free in jit)."""
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size}")
    if packed.dtype != jnp.uint32:
        raise ValueError(f"Int4Weight.packed must be uint32, got {packed.dtype}")
    if packed.ndim < 2:
        raise ValueError(f"Int4Weight.packed must be [..., K, N/8], got shape {packed.shape}")
    *lead, k, n8 = packed.shape
    want = (*lead, k // group_size, n8 * PACK)
    if k % group_size:
        raise ValueError(f"input dim K={k} is not a multiple of group_size={group_size}")
    for name, a in (("scales", scales), ("mins", mins)):
        if tuple(a.shape) != want:
            raise ValueError(
                f"Int4Weight.{name} has shape {tuple(a.shape)}, expected {want} for packed "
                f"{tuple(packed.shape)} and group_size {group_size}"
            )
        if a.dtype != STORED_DTYPE:
            raise ValueError(f"Int4Weight.{name} must be {jnp.dtype(STORED_DTYPE)}, got {a.dtype}")


def to_stored(x: jax.Array) -> jax.Array:
    """Rounds scales/mins to their stored precision (f16), returned as f32."""
    return jnp.asarray(x, jnp.float32).astype(STORED_DTYPE).astype(jnp.float32)


def pack_codes(codes: jax.Array) -> jax.Array:
    """int[..., K, N] in 0..15 -> u32[..., K, N/8] (nibble j of column c = code of col j*N/8 + c)."""
    *lead, k, n = codes.shape
    if n % PACK:
        raise ValueError(f"output dim N={n} must be a multiple of {PACK} to pack INT4 codes")
    planes = jnp.asarray(codes).astype(jnp.uint32).reshape(*lead, k, PACK, n // PACK)
    shifts = (4 * jnp.arange(PACK, dtype=jnp.uint32))[:, None]  # (8, 1)
    # Nibbles occupy disjoint bits, so the sum is a bitwise OR.
    return jnp.sum(planes << shifts, axis=-2, dtype=jnp.uint32)  # (..., K, N/8)


def unpack_codes(packed: jax.Array) -> jax.Array:
    """u32[..., K, N/8] -> u8[..., K, N]."""
    *lead, k, n8 = packed.shape
    shifts = (4 * jnp.arange(PACK, dtype=jnp.uint32))[:, None]  # (8, 1)
    planes = (packed[..., None, :] >> shifts) & jnp.uint32(0xF)  # (..., K, 8, N/8)
    return planes.astype(jnp.uint8).reshape(*lead, k, n8 * PACK)


def expand_groups(a: jax.Array, group_size: int) -> jax.Array:
    """[..., K/g, N] -> [..., K, N] (each group row repeated g times)."""
    return jnp.repeat(a, group_size, axis=-2)


def dequantize_arrays(packed, scales, mins, group_size: int) -> jax.Array:
    """The layout's definition: W = q * scale + min -> f32[..., K, N]."""
    q = unpack_codes(packed).astype(jnp.float32)
    s = expand_groups(scales.astype(jnp.float32), group_size)
    m = expand_groups(mins.astype(jnp.float32), group_size)
    return q * s + m


def pack(
    codes: jax.Array,
    scales: jax.Array,
    mins: jax.Array,
    group_size: int = DEFAULT_GROUP_SIZE,
    impl: str = "auto",
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
