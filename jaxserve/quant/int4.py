"""The INT4 weight pytree (`Int4Weight`) and the quantizer-side packing (`pack`, `to_stored`).

The packed layout itself (eight 4-bit codes per uint32, planes along the output dim; f16 scales
and mins per group of inputs; W = q * scale + min) is defined once, with its diagram, in
`pallas_kernels/int4_layout.py`, beside the kernel that reads it; its names are re-exported here.

    pack(codes, scales, mins, group_size, shards=1) -> Int4Weight  (checks code and f16 range)
    unpack(w) -> (codes, scales, mins)
    repack(w, shards) -> Int4Weight            the same codes in another shard layout (lossless)
    w.dequantize() -> f32[..., K, N];  w.matmul(x[, layer=l]);  w.take(ids)
    w.take_columns(idx[, shards]) -> Int4Weight  exactly the columns idx (copied, not requantized)
    w.partition_specs(role) -> Int4Weight of PartitionSpecs   (role: column / row / replicated)

Tensor parallelism (`quant/sharded.py`). Planes span all N, so a column shard of the S = 1 layout
would cut planes apart. The static field `shards` = S packs each of S contiguous blocks of N/S
columns on its own (diagram in `int4_layout.py`): with S = T, device s's slice of `packed` is the
S = 1 weight of its own columns, and the kernel runs on it unchanged. S = 1 is the original
layout, bit for bit. Row-parallel splits cut K and need (K/T) % group_size == 0. The partition
rules set the static field `parallel` ('column' / 'row'); under `jax.set_mesh` with a 'model'
axis of size T > 1, `matmul` and `take` then run the local kernel in `jax.shard_map`.

Every leaf may carry leading axes (a stacked layer axis [L, ...]). `matmul` needs one layer: a 2-D
weight, or a stack [L, K, N] and the index of the layer (`matmul(x, layer=l)`: the fused kernel
reads that layer in place, so the model's `lax.scan` passes the stack whole). So does
`take(ids)`, the column gather W[:, ids].T that looks up an embedding table stored in the
lm_head view [D, V] (it unpacks only the gathered columns).

The matmul implementation is a static field, `impl`, chosen when the engine is built (the runner
sets it with `jaxserve.quant.with_matmul_impl`: 'pallas' or 'mgpu' on GPU, 'xla' elsewhere;
`quant/impls.py`); nothing reads the backend while tracing. 'pallas' runs the fused Triton kernel
for up to `kernel_rows` rows (decode) and XLA's unpack + dot for more (prefill), which is faster
there (JOURNAL.md 48); 'mgpu' the Mosaic GPU kernel (`pallas_kernels/mgpu_w4_matmul.py`) in its
place where it accepts the call (bf16 rows, the plain packing, its tile multiples), else the
Triton kernel. `kernel_rows`, static too, is the engine's GPU's (the GPU kernel table,
`config/gpu_kernel_choices.toml`, through `with_matmul_impl`), else `PALLAS_MAX_ROWS`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxserve.quant import sharded
from jaxserve.quant.impls import (
    IMPLS,
    KERNELS,
    MGPU_IMPLS,
    check_kernel_rows,
    mgpu_accepts,
    triton_twin,
)
from pallas_kernels.int4_layout import (
    GROUP_SIZES,
    PACK,
    STORED_DTYPE,
    check_arrays,
    check_shards,
    column_position,
    dequantize_arrays,
    expand_groups,
    pack_codes,
    repack_codes,
    unpack_codes,
)
from pallas_kernels.int4_matmul import int4_matmul
from pallas_kernels.mgpu_tuning import H100_MGPU_W4
from pallas_kernels.mgpu_w4_matmul import check_mgpu_w4_inputs, int4_matmul_mgpu

DEFAULT_GROUP_SIZE = 128
DEFAULT_IMPL = "xla"  # runs on every backend; the engine picks 'pallas' on GPU
# Rows up to which a kernel impl set by hand runs its kernel (the weights' default `kernel_rows`);
# more rows (a prefill chunk, a decode batch of 32+) take the XLA unpack + dot. An engine's 'auto'
# takes its GPU's limit from the GPU kernel table (config/gpu_kernel_choices.toml), today this on
# every chip: on the H200 the kernel took 0.35-0.5x XLA's time at 1 and 8 rows and 1.2-3.4x at
# 32 to 512 rows (Llama-3-8B projections, bf16; JOURNAL.md 48).
PALLAS_MAX_ROWS = 16


@struct.dataclass
class Int4Weight:
    """Packed INT4 weight of logical shape [..., K, N] (layout: `pallas_kernels/int4_layout.py`).

    impl picks the matmul, statically: 'xla' (unpack + dot, the default: runs everywhere),
    'pallas' (the fused kernel, GPU), 'mgpu' (its Mosaic GPU port, Hopper), '*_interpret' (those
    kernels interpreted, CPU tests) or 'reference' (f32 jnp). The engine sets it for its backend (`quant.with_matmul_impl`).

    kernel_rows: impl 'pallas' / 'mgpu' run the kernel on up to this many rows, XLA beyond.
    shards: the N columns are packed as this many blocks of N/shards (1: the plain layout).
    parallel: None, 'column' or 'row': how the partition rules split it over the 'model' axis.
    """

    packed: jax.Array  # u32[..., K, N // 8]
    scales: jax.Array  # f16[..., K // group_size, N]
    mins: jax.Array  # f16[..., K // group_size, N]
    group_size: int = struct.field(pytree_node=False, default=DEFAULT_GROUP_SIZE)
    impl: str = struct.field(pytree_node=False, default=DEFAULT_IMPL)
    kernel_rows: int = struct.field(pytree_node=False, default=PALLAS_MAX_ROWS)
    shards: int = struct.field(pytree_node=False, default=1)
    parallel: str | None = struct.field(pytree_node=False, default=None)

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
        check_arrays(self.packed, self.scales, self.mins, self.group_size, self.shards)
        if self.impl not in IMPLS:
            raise ValueError(f"Int4Weight.impl must be one of {IMPLS}, got {self.impl!r}")
        check_kernel_rows(type(self).__name__, self.kernel_rows)
        sharded.check_parallel(self.parallel)

    def dequantize(self) -> jax.Array:
        """-> f32[..., K, N]."""
        self.check()
        return dequantize_arrays(self.packed, self.scales, self.mins, self.group_size, self.shards)

    def take(self, ids: jax.Array, dtype=jnp.float32) -> jax.Array:
        """Columns of W: ids int[...] -> W[:, ids].T [..., K] in dtype, unpacking only those.

        The embedding lookup of a table stored in the lm_head view [D, V] (`layers.embedding`).
        Column n's code is one nibble of one packed column (`int4_layout.column_position`), scaled
        by scales[:, n], mins[:, n]. ids outside [0, N) are clamped. Vocab-parallel (`parallel=
        'column'` under a mesh): each device looks up its own columns, a psum gathers them.
        """
        self.check()
        if self.packed.ndim != 2:
            raise ValueError(f"Int4Weight.take needs one weight [K, N]; got shape {self.shape}")
        return sharded.take(self, ids, dtype, _take_local)

    def matmul(
        self, x: jax.Array, impl: str | None = None, layer=None, tile_rows: int | None = None
    ) -> jax.Array:
        """x[..., K] @ W[K, N] -> [..., N] in x.dtype (f32 accumulation).

        layer: i32[] or int: the weight is a stack [L, K, N] and W is its layer `layer`.
        tile_rows: a tiled call (`pallas_kernels/tiles.py`, a mixture of experts): x [T * b, K],
          layer i32[T], tile t's b = tile_rows rows times layer layer[t] (negative: zeros); the
          kernel impls run it when b <= kernel_rows, else XLA per tile.
        Under a mesh that splits 'model' and with `parallel` set, runs in `jax.shard_map`.
        """
        self.check()
        if self.packed.ndim != (2 if layer is None else 3):
            raise ValueError(
                f"Int4Weight.matmul needs one layer's weight [K, N], or a stack [L, K, N] with "
                f"layer=; got shape {self.shape} and layer={layer!r}"
            )
        if x.ndim < 1 or x.shape[-1] != self.shape[-2]:
            raise ValueError(f"x has shape {x.shape}; its last dim must be K={self.shape[-2]}")
        if impl is None:
            impl = self.impl
            rows = tile_rows or int(np.prod(x.shape[:-1]))  # a tiled call: the kernel's block
            if impl in ("pallas", "mgpu") and rows > self.kernel_rows:
                impl = "xla"

        def local(w, x, layer, out_dtype):
            args = (x, w.packed, w.scales, w.mins, w.group_size, layer, w.shards, H100_MGPU_W4)
            if (
                tile_rows is None
                and impl in MGPU_IMPLS
                and mgpu_accepts(check_mgpu_w4_inputs, *args)
            ):
                return int4_matmul_mgpu(
                    x,
                    w.packed,
                    w.scales,
                    w.mins,
                    group_size=w.group_size,
                    layer=layer,
                    out_dtype=out_dtype,
                    interpret=impl == "mgpu_interpret",
                )
            return int4_matmul(
                x,
                w.packed,
                w.scales,
                w.mins,
                group_size=w.group_size,
                impl=triton_twin(impl),
                layer=layer,
                shards=w.shards,
                out_dtype=out_dtype,
                tile_rows=tile_rows,
            )

        return sharded.matmul(self, x, layer, local)

    def tiles_in_place(self, tile_rows: int) -> bool:
        """Whether `matmul(x, layer=tiles, tile_rows=tile_rows)` on this stack runs the kernel,
        each tile reading its layer in place (a kernel impl, tiles within `kernel_rows`, the
        plain packing): the mixture of experts' 'kernel' path (`layers/moe.py`)."""
        return self.impl in KERNELS and tile_rows <= self.kernel_rows and self.shards == 1

    def partition_specs(self, role: str, axis: str = sharded.AXIS, size: int | None = None):
        """-> Int4Weight whose leaves are PartitionSpecs (leading stacked axes unsplit).

        role 'column': N split (packed's last axis, scales/mins' last axis); needs shards == T.
        role 'row': K split (packed's K axis, scales/mins' group axis); needs (K/T) % g == 0.
        role 'replicated': nothing split. size: T, checked when given or when the current mesh
        has `axis` (else unchecked).
        """
        sharded.check_role(role)
        nd = self.packed.ndim
        t = sharded.spec_size(size, axis)
        if t is not None and role != "replicated":
            self._local_fields(role, t)  # raises when the weight cannot split over t
        dim = {"column": -1, "row": -2, "replicated": -1}[role]
        name = None if role == "replicated" else axis
        return self.replace(
            packed=sharded.spec(nd, name, dim),
            scales=sharded.spec(nd, name, dim),
            mins=sharded.spec(nd, name, dim),
        )

    def _local_fields(self, role: str, t: int) -> dict:
        """Static fields of one device's shard over t devices (see `sharded`)."""
        k, n = self.shape[-2:]
        if role == "column":
            if self.shards != t:
                raise ValueError(
                    f"a column-parallel Int4Weight over T={t} devices must be packed with "
                    f"shards={t}, got shards={self.shards} (N={n}); use int4.repack(w, {t})"
                )
            return {"shards": 1}
        sharded.row_group_check(k, t, self.group_size)
        return {}

    def take_columns(self, idx, shards: int = 1) -> Int4Weight:
        """The weight of exactly the output columns idx (static ints, in that order, repeats
        allowed), packed with `shards`: codes, scales and mins copied bit for bit."""
        idx = _column_indices(idx, self.shape[-1], "Int4Weight")
        codes = unpack_codes(self.packed, self.shards)[..., idx]  # (..., K, len(idx))
        return self.replace(
            packed=pack_codes(codes, shards),
            scales=self.scales[..., idx],
            mins=self.mins[..., idx],
            shards=shards,
        )


def _take_local(w: Int4Weight, ids: jax.Array, dtype) -> jax.Array:
    """One device's `take`: ids int[...] -> W[:, ids].T [..., K]."""
    ids = jnp.asarray(ids)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"Int4Weight.take: ids must be integers, got {ids.dtype}")
    k, n8 = w.packed.shape
    flat = jnp.clip(ids.reshape(-1).astype(jnp.int32), 0, n8 * PACK - 1)  # (n,)
    col, nibble = column_position(flat, n8 * PACK, w.shards)  # (n,), (n,)
    words = jnp.take(w.packed, col, axis=1)  # (K, n)
    shifts = (4 * nibble).astype(jnp.uint32)  # (n,) the column's nibble
    codes = ((words >> shifts) & jnp.uint32(0xF)).astype(jnp.float32)  # (K, n)
    s = expand_groups(jnp.take(w.scales, flat, axis=1).astype(jnp.float32), w.group_size)
    m = expand_groups(jnp.take(w.mins, flat, axis=1).astype(jnp.float32), w.group_size)
    cols = codes * s + m  # (K, n)
    return cols.T.reshape(*ids.shape, k).astype(dtype)  # (..., K)


def _column_indices(idx, n: int, name: str) -> np.ndarray:
    """Static column indices int[n_out] in [0, N), or ValueError naming the offender."""
    idx = np.asarray(idx)
    if idx.ndim != 1 or not np.issubdtype(idx.dtype, np.integer):
        raise ValueError(f"{name}.take_columns: idx must be 1-D ints, got {idx.dtype}{idx.shape}")
    bad = idx[(idx < 0) | (idx >= n)]
    if bad.size:
        raise ValueError(f"{name}.take_columns: column {int(bad[0])} is outside [0, N={n})")
    return idx


def repack(w: Int4Weight, shards: int) -> Int4Weight:
    """The same weight packed with `shards` column blocks (lossless: only nibbles move)."""
    w.check()
    return w.replace(packed=repack_codes(w.packed, w.shards, shards), shards=shards)


def to_stored(x: jax.Array) -> jax.Array:
    """Rounds scales/mins to their stored precision (f16), returned as f32."""
    return jnp.asarray(x, jnp.float32).astype(STORED_DTYPE).astype(jnp.float32)


def pack(
    codes: jax.Array,
    scales: jax.Array,
    mins: jax.Array,
    group_size: int = DEFAULT_GROUP_SIZE,
    impl: str = DEFAULT_IMPL,
    shards: int = 1,
) -> Int4Weight:
    """codes int[..., K, N] in 0..15, scales/mins f32[..., K/g, N] -> Int4Weight, the N columns
    packed as `shards` blocks (`int4_layout.py`).

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
    check_shards(n, shards)
    packed, s16, m16, stats = _pack_arrays(codes, jnp.asarray(scales), jnp.asarray(mins), shards)
    if not isinstance(stats, jax.core.Tracer):  # concrete: check values too (one device sync)
        lo, hi, finite_scales, finite_mins = (int(v) for v in np.asarray(stats))
        if lo < 0 or hi > 15:
            raise ValueError(f"INT4 codes must be in 0..15, got range [{lo}, {hi}]")
        for name, ok in (("scales", finite_scales), ("mins", finite_mins)):
            if not ok:
                raise ValueError(f"{name} are not finite in float16 (|value| > 65504 or NaN)")
    w = Int4Weight(packed, s16, m16, group_size=group_size, impl=impl, shards=shards)
    w.check()
    return w


@functools.partial(jax.jit, static_argnames=("shards",))
def _pack_arrays(codes, scales, mins, shards):
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
    return pack_codes(codes, shards), s16, m16, stats


def unpack(w: Int4Weight) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Int4Weight -> (codes u8[..., K, N], scales f32[..., K/g, N], mins f32[..., K/g, N])."""
    w.check()
    return (
        unpack_codes(w.packed, w.shards),
        w.scales.astype(jnp.float32),
        w.mins.astype(jnp.float32),
    )
