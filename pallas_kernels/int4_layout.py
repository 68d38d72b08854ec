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

so `unpack_codes` is a shift/mask into [K, 8, N/8] followed by a free reshape to [K, N], and
`pack_codes` its inverse.

Shards (tensor parallelism). Planes span all N, so a column shard of packed[:, c0:c1] would hold
a slice of every plane, not contiguous columns. With `shards = S` (a static field of the weight;
S = 1 is the layout above, bit for bit) the N columns are first cut into S contiguous blocks of
N/S, and each block is packed on its own with the eight-plane layout:

    W[k, :]       = [ block 0: cols 0..N/S-1 | block 1: N/S..2N/S-1 | ... | block S-1 ]
    packed[k, :]  = [ pack(block 0)  u32[N/(8S)] | pack(block 1) | ... | pack(block S-1) ]

    nibble j of packed[k, s*N/(8S) + c] = code of column s*N/S + j*N/(8S) + c

so packed[:, s*N/(8S):(s+1)*N/(8S)] is exactly the S = 1 packing of columns s*N/S..(s+1)*N/S-1,
and a column-parallel weight over T devices (S = T) gives every device a plain S = 1 weight: the
kernel runs unchanged on each shard. Scales and mins are not packed, so they are [K/g, N] in
column order for every S. N must be a multiple of 8*S. `repack_codes` converts between S values
losslessly (it only moves nibbles). Row-parallel shards cut K, which packing never touches; they
must fall on group boundaries ((K/T) % g == 0) so that each device's groups are whole.

Why eight per uint32 in planes along N (not two per uint8, not interleaved, not along K):
  * the fused kernel (`int4_matmul.py`) loads one u32 tile [bk, bc] and gets eight [bk, bc] code
    tiles with one shift and mask each, each multiplying the SAME activation tile x[:, k-block]
    into the output columns of its plane. Nibbles interleaved along a tile axis (two per u8 along
    K, as many kernels do) need an in-register join/reshape/transpose to un-interleave, which
    Triton turns into layout conversions through shared memory; planes need none. Packing along N
    keeps the group axis (K) whole, so a group's scales are a plain row slice [1, bc] applied
    after the dot:
        x_g @ W_g = scales_g * (x_g @ q_g) + mins_g * sum_k x_g;
  * u8 would give two planes per byte and the same bytes; u32 gives eight planes from one 2-D
    block load with no byte-level indexing, and shifts are native 32-bit integer ops;
  * the XLA/CPU path unpacks with one broadcasted shift and a reshape.
The cost: N must be a multiple of 8 (true of every real model's projections), 8*S when sharded.

Scales and mins are stored as float16: GGUF's own precision (so Q4_1/Q4_0 import is exact) and at
g=128 the INT4 weight is (0.5 + 4/128) bytes per value = 0.266x of bf16. Quantizers must compute
codes against the stored scales (`jaxserve/quant/int4.py` rounds with `to_stored` first).

Every array may carry leading axes (a stacked layer axis [L, ...]). This module is the layout at
the level of arrays, for the kernel and its reference; the weight pytree that carries the three
arrays (`Int4Weight`) and the quantizer-side packing with value checks (`pack`) are in
`jaxserve/quant/int4.py`. Imports jax only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

GROUP_SIZES = (32, 64, 128)
PACK = 8  # codes per uint32
STORED_DTYPE = jnp.float16  # scales and mins


def check_shards(n: int, shards: int) -> None:
    """Raises ValueError unless N columns can be cut into `shards` blocks packed on their own."""
    if not isinstance(shards, int) or isinstance(shards, bool) or shards < 1:
        raise ValueError(f"INT4 shards must be a positive int, got {shards!r}")
    if n % (PACK * shards):
        raise ValueError(
            f"output dim N={n} must be a multiple of {PACK} * shards = {PACK * shards} to pack "
            f"INT4 codes in {shards} shard(s) of {PACK}-column planes"
        )


def check_arrays(packed, scales, mins, group_size: int, shards: int = 1) -> None:
    """Shape/dtype checks of a packed weight's arrays (shapes are static, so this is free in jit)."""
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size}")
    if packed.dtype != jnp.uint32:
        raise ValueError(f"Int4Weight.packed must be uint32, got {packed.dtype}")
    if packed.ndim < 2:
        raise ValueError(f"Int4Weight.packed must be [..., K, N/8], got shape {packed.shape}")
    *lead, k, n8 = packed.shape
    check_shards(n8 * PACK, shards)
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


_SHIFTS = lambda: (4 * jnp.arange(PACK, dtype=jnp.uint32))[:, None]  # (8, 1)


def pack_codes(codes: jax.Array, shards: int = 1) -> jax.Array:
    """int[..., K, N] in 0..15 -> u32[..., K, N/8]: nibble j of packed column s*N/(8S) + c holds
    column s*N/S + j*N/(8S) + c (S = shards; S = 1: column j*N/8 + c)."""
    *lead, k, n = codes.shape
    check_shards(n, shards)
    n8s = n // (PACK * shards)
    # (..., K, S, 8, N/(8S)): block s, plane j, packed column c
    planes = jnp.asarray(codes).astype(jnp.uint32).reshape(*lead, k, shards, PACK, n8s)
    # Nibbles occupy disjoint bits, so the sum is a bitwise OR.
    words = jnp.sum(planes << _SHIFTS(), axis=-2, dtype=jnp.uint32)  # (..., K, S, N/(8S))
    return words.reshape(*lead, k, n // PACK)


def unpack_codes(packed: jax.Array, shards: int = 1) -> jax.Array:
    """u32[..., K, N/8] -> u8[..., K, N] (the inverse of `pack_codes` with the same shards)."""
    *lead, k, n8 = packed.shape
    check_shards(n8 * PACK, shards)
    blocks = packed.reshape(*lead, k, shards, 1, n8 // shards)  # (..., K, S, 1, N/(8S))
    planes = (blocks >> _SHIFTS()) & jnp.uint32(0xF)  # (..., K, S, 8, N/(8S))
    return planes.astype(jnp.uint8).reshape(*lead, k, n8 * PACK)


def repack_codes(packed: jax.Array, shards: int, new_shards: int) -> jax.Array:
    """u32[..., K, N/8] packed with `shards` -> the same codes packed with `new_shards` (exact)."""
    if shards == new_shards:
        return packed
    return pack_codes(unpack_codes(packed, shards), new_shards)


def column_position(cols: jax.Array, n: int, shards: int = 1) -> tuple[jax.Array, jax.Array]:
    """Output columns int[...] in [0, N) -> (packed column, nibble) holding each one's code."""
    n8s = n // (PACK * shards)
    block, r = cols // (n // shards), cols % (n // shards)
    return block * n8s + r % n8s, r // n8s


def kernel_column_order(a: jax.Array, shards: int) -> jax.Array:
    """[..., N] in column order -> [..., N] in packed order: index j*N/8 + c holds the column that
    nibble j of packed column c codes (the identity for shards = 1)."""
    if shards == 1:
        return a
    *lead, n = a.shape
    a = a.reshape(*lead, shards, PACK, n // (PACK * shards))  # (..., S, 8, N/(8S))
    return jnp.swapaxes(a, -3, -2).reshape(*lead, n)  # (..., 8, S, N/(8S)) -> (..., N)


def column_order(a: jax.Array, shards: int) -> jax.Array:
    """The inverse of `kernel_column_order`: [..., N] in packed order -> column order."""
    if shards == 1:
        return a
    *lead, n = a.shape
    a = a.reshape(*lead, PACK, shards, n // (PACK * shards))  # (..., 8, S, N/(8S))
    return jnp.swapaxes(a, -3, -2).reshape(*lead, n)


def expand_groups(a: jax.Array, group_size: int) -> jax.Array:
    """[..., K/g, N] -> [..., K, N] (each group row repeated g times)."""
    return jnp.repeat(a, group_size, axis=-2)


def dequantize_arrays(packed, scales, mins, group_size: int, shards: int = 1) -> jax.Array:
    """The layout's definition: W = q * scale + min -> f32[..., K, N]."""
    q = unpack_codes(packed, shards).astype(jnp.float32)
    s = expand_groups(scales.astype(jnp.float32), group_size)
    m = expand_groups(mins.astype(jnp.float32), group_size)
    return q * s + m
