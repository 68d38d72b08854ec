"""INT8 and FP8 (e4m3) weight-only quantization with per-output-channel (or per-group) scales.

    W[k, n] = q[k, n] * scales[k // g, n]      q: int8 or float8_e4m3fn[..., K, N]

Per-output-channel is one group spanning all of K (scales [..., 1, N]): the scale then factors out
of the dot, `(x @ q) * scale`, so the weight is never dequantized. GGUF Q8_0 (blocks of 32 inputs,
an f16 scale each) imports exactly as g = 32 (`loading/gguf_native.py`); that path dequantizes then
dots.

    int8: scale = amax / 127,  q = round(w / scale)          in -127..127
    fp8:  scale = amax / 448,  q = float8_e4m3fn(w / scale)  (448 = e4m3's largest finite value)

Leaves may carry a leading layer axis [L, ...] (scanned like any array); `matmul` needs one layer
(a 2-D weight, or a stack and `layer=`, which it slices out). `take(ids)` gathers columns
W[:, ids].T: the lookup of an embedding table kept in the lm_head view [D, V] (GGUF's Q8_0
token_embd imports that way, exactly). `take_columns(idx)` copies exactly the columns idx.

On GPU the engine sets `impl='pallas'` or 'mgpu' (`quant/impls.py`): a per-channel stack is then
handed to `matmul` whole with the layer index, and decode batches run a W8A16 kernel (Triton:
`pallas_kernels/w8_matmul.py`; Mosaic GPU: `mgpu_w8_matmul.py`), which reads the layer in place
(XLA would copy it out of the stack first under the layer scan).

Tensor parallelism (`quant/sharded.py`): `partition_specs(role)` splits q and scales along N
(column) or K (row; scales' group axis, or replicated scales for per-channel weights, whose one
group then spans each device's K/T rows). With `parallel` set and a mesh splitting 'model',
`matmul` and `take` run the local code under `jax.shard_map`.
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
from pallas_kernels.mgpu_tuning import H100_MGPU_W8
from pallas_kernels.mgpu_w8_matmul import check_mgpu_w8_inputs, w8_matmul_mgpu
from pallas_kernels.tiles import check_tiles, per_tile
from pallas_kernels.w8_matmul import w8_matmul

# Rows up to which a kernel impl set by hand runs the W8A16 kernel on a layer of a stack (the
# weights' default `kernel_rows`: decode batches); more rows (a prefill chunk: compute-bound) take
# XLA's convert + dot on the sliced layer. An engine's 'auto' takes its GPU's limit from the GPU
# kernel table (config/gpu_kernel_choices.toml), today this on every chip.
PALLAS_MAX_ROWS = 64

FP8_MAX = 448.0
INT8_MAX = 127.0


def _check(name: str, q, scales, group_size: int, dtype) -> None:
    if q.dtype != dtype:
        raise ValueError(f"{name}.q must be {jnp.dtype(dtype)}, got {q.dtype}")
    if q.ndim < 2:
        raise ValueError(f"{name}.q must be [..., K, N], got shape {q.shape}")
    *lead, k, n = q.shape
    if group_size <= 0 or k % group_size:
        raise ValueError(f"{name}: group_size {group_size} does not divide the input dim K={k}")
    want = (*lead, k // group_size, n)
    if tuple(scales.shape) != want:
        raise ValueError(f"{name}.scales has shape {tuple(scales.shape)}, expected {want}")
    if scales.dtype != jnp.float32:
        raise ValueError(f"{name}.scales must be float32, got {scales.dtype}")


def _dequantize(q, scales, group_size: int) -> jax.Array:
    return q.astype(jnp.float32) * jnp.repeat(scales, group_size, axis=-2)


def _matmul(name: str, q, scales, group_size: int, x: jax.Array, out_dtype=None) -> jax.Array:
    """x[..., K] @ (q * scales)[K, N] -> [..., N] in out_dtype (default x.dtype)."""
    out_dtype = out_dtype or x.dtype
    if q.ndim != 2:
        raise ValueError(f"{name}.matmul needs one layer's weight [K, N]; got shape {q.shape}")
    if x.shape[-1] != q.shape[0]:
        raise ValueError(f"{name}.matmul: x has last dim {x.shape[-1]}, weight has K={q.shape[0]}")
    if scales.shape[0] == 1:  # per-channel: the scale factors out of the dot
        y = jnp.einsum("...k,kn->...n", x, q.astype(x.dtype), preferred_element_type=jnp.float32)
        return (y * scales[0]).astype(out_dtype)
    w = _dequantize(q, scales, group_size).astype(x.dtype)
    return jnp.einsum("...k,kn->...n", x, w, preferred_element_type=jnp.float32).astype(out_dtype)


def _take(name: str, q, scales, group_size: int, ids, dtype) -> jax.Array:
    """Columns of W = q * scales: ids int[...] -> W[:, ids].T [..., K] in dtype (clamped ids).

    The embedding lookup of a table stored in the lm_head view [D, V] (`layers.embedding`).
    """
    if q.ndim != 2:
        raise ValueError(f"{name}.take needs one weight [K, N]; got shape {q.shape}")
    ids = jnp.asarray(ids)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"{name}.take: ids must be integers, got {ids.dtype}")
    k, n = q.shape
    flat = jnp.clip(ids.reshape(-1).astype(jnp.int32), 0, n - 1)  # (n_ids,)
    cols = jnp.take(q, flat, axis=1).astype(jnp.float32)  # (K, n_ids)
    cols = cols * jnp.repeat(jnp.take(scales, flat, axis=1), group_size, axis=0)
    return cols.T.reshape(*ids.shape, k).astype(dtype)  # (..., K)


def _nbytes(*arrays) -> int:
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in arrays)


class _ScaledWeight:
    """Shared methods of the per-channel 8-bit weights; subclasses set QDTYPE and the fields."""

    QDTYPE = None  # element dtype of q

    shape = property(lambda self: tuple(self.q.shape))
    ndim = property(lambda self: self.q.ndim)
    nbytes = property(lambda self: _nbytes(self.q, self.scales))

    def check(self) -> None:
        _check(type(self).__name__, self.q, self.scales, self.group_size, self.QDTYPE)
        sharded.check_parallel(self.parallel)
        if self.impl not in IMPLS:
            raise ValueError(
                f"{type(self).__name__}.impl must be one of {IMPLS}, got {self.impl!r}"
            )
        check_kernel_rows(type(self).__name__, self.kernel_rows)

    @property
    def per_channel(self) -> bool:
        return self.scales.shape[-2] == 1

    @property
    def reads_layer_in_place(self) -> bool:
        """Whether the model hands this stack to `matmul` whole, with the layer index: the
        W8A16 kernels (a kernel impl, per-channel scales) read the layer where it lies; XLA's
        convert + dot would get it copied out of the stack under the layer scan anyway."""
        return self.impl in KERNELS and self.per_channel

    def tiles_in_place(self, tile_rows: int) -> bool:
        """Whether `matmul(x, layer=tiles, tile_rows=tile_rows)` on this stack runs the W8A16
        kernel, each tile reading its layer in place (`reads_layer_in_place`, tiles within
        `kernel_rows`): the mixture of experts' 'kernel' path (`layers/moe.py`)."""
        return self.reads_layer_in_place and tile_rows <= self.kernel_rows

    def concat_out(self, others) -> _ScaledWeight:
        """This weight and `others` (the same kind, group size and K) as one [..., K, sum(N)]
        weight: q and scales side by side on the output axis (the GPU's fused q/k/v and gate/up
        stacks, `layers/linear.fuse_projections`)."""
        ws = [self, *others]
        if len({(type(w), w.group_size, w.q.shape[:-1], w.impl, w.parallel) for w in ws}) != 1:
            raise ValueError("concat_out needs weights of one kind, group size, K and impl")
        return self.replace(
            q=jnp.concatenate([w.q for w in ws], axis=-1),
            scales=jnp.concatenate([w.scales for w in ws], axis=-1),
        )

    def dequantize(self) -> jax.Array:
        """-> f32[..., K, N]."""
        self.check()
        return _dequantize(self.q, self.scales, self.group_size)

    def matmul(self, x: jax.Array, layer=None, tile_rows: int | None = None) -> jax.Array:
        """x[..., K] @ W -> [..., N] in x.dtype; layer: W is layer `layer` of a stack [L, K, N].

        tile_rows: a tiled call (`pallas_kernels/tiles.py`, a mixture of experts): x [T * b, K],
          layer i32[T], tile t's b = tile_rows rows times layer layer[t] (negative: zeros); the
          kernel impls run it when b <= kernel_rows (per-channel scales), else XLA per tile.
        Under a mesh that splits 'model' and with `parallel` set, runs in `jax.shard_map`.
        """
        self.check()
        name = type(self).__name__
        if self.q.ndim != (2 if layer is None else 3):
            raise ValueError(
                f"{name}.matmul needs one layer's weight [K, N], or a stack [L, K, N] with "
                f"layer=; got shape {self.shape} and layer={layer!r}"
            )
        if x.ndim < 1 or x.shape[-1] != self.shape[-2]:
            raise ValueError(f"{name}.matmul: x has shape {x.shape}, weight has K={self.shape[-2]}")

        def local(w, x, layer, out_dtype):
            q, scales = w.q, w.scales
            rows = tile_rows or int(np.prod(x.shape[:-1]))  # a tiled call: the kernel's block
            if layer is not None and w.reads_layer_in_place and rows <= w.kernel_rows:
                if (
                    tile_rows is None
                    and w.impl in MGPU_IMPLS
                    and mgpu_accepts(check_mgpu_w8_inputs, x, q, scales, layer, H100_MGPU_W8)
                ):
                    interpret = w.impl == "mgpu_interpret"
                    return w8_matmul_mgpu(
                        x, q, scales, layer, out_dtype=out_dtype, interpret=interpret
                    )
                impl = triton_twin(w.impl)
                return w8_matmul(
                    x, q, scales, impl=impl, layer=layer, out_dtype=out_dtype, tile_rows=tile_rows
                )
            if tile_rows is not None:  # XLA per tile, each slicing its layer out

                def one(rows, li):
                    ql, sl = (
                        jax.lax.dynamic_index_in_dim(a, li, keepdims=False) for a in (q, scales)
                    )
                    return _matmul(name, ql, sl, w.group_size, rows, out_dtype)

                check_tiles(x.shape[0], layer, tile_rows, kernel=False)
                return per_tile(one, x, jnp.asarray(layer, jnp.int32), tile_rows)
            if layer is not None:
                q, scales = (
                    jax.lax.dynamic_index_in_dim(a, layer, keepdims=False) for a in (q, scales)
                )
            return _matmul(name, q, scales, w.group_size, x, out_dtype)

        return sharded.matmul(self, x, layer, local)

    def take(self, ids: jax.Array, dtype=jnp.float32) -> jax.Array:
        """Columns ids int[...] -> W[:, ids].T [..., K] in dtype (an embedding lookup)."""
        self.check()
        name = type(self).__name__

        def local(w, ids, dtype):
            return _take(name, w.q, w.scales, w.group_size, ids, dtype)

        return sharded.take(self, ids, dtype, local)

    def partition_specs(self, role: str, axis: str = sharded.AXIS, size: int | None = None):
        """-> the same class with PartitionSpec leaves (leading stacked axes unsplit).

        role 'column': q and scales split on N. role 'row': q split on K; scales on their group
        axis, or replicated for a per-channel weight (one group); needs (K/T) % group_size == 0
        otherwise. role 'replicated': nothing split. size: T, checked when given or when the
        current mesh has `axis`.
        """
        sharded.check_role(role)
        nd = self.q.ndim
        t = sharded.spec_size(size, axis)
        if t is not None and role != "replicated":
            self._local_fields(role, t)  # raises when the weight cannot split over t
        if role == "replicated":
            return self.replace(q=sharded.spec(nd, None, -1), scales=sharded.spec(nd, None, -1))
        if role == "column":
            return self.replace(q=sharded.spec(nd, axis, -1), scales=sharded.spec(nd, axis, -1))
        per_channel = self.scales.shape[-2] == 1
        return self.replace(
            q=sharded.spec(nd, axis, -2), scales=sharded.spec(nd, None if per_channel else axis, -2)
        )

    def _local_fields(self, role: str, t: int) -> dict:
        """Static fields of one device's shard over t devices (see `sharded`)."""
        k, n = self.shape[-2:]
        if role == "column":
            if n % t:
                raise ValueError(f"column-parallel split of N={n} over T={t} devices: N % T != 0")
            return {}
        if self.scales.shape[-2] == 1:  # per-channel: the one group spans each device's rows
            if k % t:
                raise ValueError(f"row-parallel split of K={k} over T={t} devices: K % T != 0")
            return {"group_size": k // t}
        sharded.row_group_check(k, t, self.group_size)
        return {}

    def take_columns(self, idx):
        """The weight of exactly the output columns idx (static ints, in that order, repeats
        allowed): q and scales copied bit for bit."""
        idx = np.asarray(idx)
        n = self.shape[-1]
        if idx.ndim != 1 or not np.issubdtype(idx.dtype, np.integer):
            raise ValueError(
                f"{type(self).__name__}.take_columns: idx must be 1-D ints, got {idx.dtype}{idx.shape}"
            )
        bad = idx[(idx < 0) | (idx >= n)]
        if bad.size:
            raise ValueError(
                f"{type(self).__name__}.take_columns: column {int(bad[0])} is outside [0, N={n})"
            )
        return self.replace(q=self.q[..., idx], scales=self.scales[..., idx])


@struct.dataclass
class Int8Weight(_ScaledWeight):
    """INT8 weight of logical shape [..., K, N]; group_size == K is per-output-channel."""

    QDTYPE = jnp.int8

    q: jax.Array  # i8[..., K, N]
    scales: jax.Array  # f32[..., K // group_size, N]
    group_size: int = struct.field(pytree_node=False)
    parallel: str | None = struct.field(pytree_node=False, default=None)  # see `quant/sharded.py`
    # the matmul (`quant/impls.py`): 'xla' (convert + dot, every backend), 'pallas' / 'mgpu' (a
    # W8A16 kernel on a layer of a stack, up to kernel_rows rows; GPU), '*_interpret' (CPU
    # tests); set by the engine (`quant.with_matmul_impl`), as is kernel_rows
    impl: str = struct.field(pytree_node=False, default="xla")
    kernel_rows: int = struct.field(pytree_node=False, default=PALLAS_MAX_ROWS)


@struct.dataclass
class Fp8Weight(_ScaledWeight):
    """FP8 (e4m3fn) weight of logical shape [..., K, N] with per-output-channel scales."""

    QDTYPE = jnp.float8_e4m3fn

    q: jax.Array  # f8e4m3fn[..., K, N]
    scales: jax.Array  # f32[..., K // group_size, N]
    group_size: int = struct.field(pytree_node=False)
    parallel: str | None = struct.field(pytree_node=False, default=None)  # see `quant/sharded.py`
    # the matmul (`quant/impls.py`): 'xla' (convert + dot, every backend), 'pallas' / 'mgpu' (a
    # W8A16 kernel on a layer of a stack, up to kernel_rows rows; GPU), '*_interpret' (CPU
    # tests); set by the engine (`quant.with_matmul_impl`), as is kernel_rows
    impl: str = struct.field(pytree_node=False, default="xla")
    kernel_rows: int = struct.field(pytree_node=False, default=PALLAS_MAX_ROWS)


@functools.partial(jax.jit, static_argnames=("fp8",))
def _per_channel(w: jax.Array, fp8: bool) -> tuple[jax.Array, jax.Array]:
    w = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w), axis=-2, keepdims=True)  # (..., 1, N)
    scale = jnp.where(amax > 0, amax / (FP8_MAX if fp8 else INT8_MAX), 1.0)
    if fp8:
        return (w / scale).astype(jnp.float8_e4m3fn), scale
    return jnp.clip(jnp.round(w / scale), -INT8_MAX, INT8_MAX).astype(jnp.int8), scale


def quantize_int8(w: jax.Array) -> Int8Weight:
    """w[..., K, N] -> Int8Weight with per-output-channel scales (amax / 127)."""
    q, scales = _per_channel(w, fp8=False)
    return Int8Weight(q, scales, group_size=w.shape[-2])


def quantize_fp8(w: jax.Array) -> Fp8Weight:
    """w[..., K, N] -> Fp8Weight (e4m3fn) with per-output-channel scales (amax / 448)."""
    q, scales = _per_channel(w, fp8=True)
    return Fp8Weight(q, scales, group_size=w.shape[-2])
