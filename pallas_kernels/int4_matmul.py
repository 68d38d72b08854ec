"""W4A16 matmul with the dequantization fused in: x[M, K] @ W[K, N], W in the packed INT4 layout.

Layout (defined, with its diagram, in `int4_layout.py`): packed u32[K, N/8] where nibble j of
packed column c is the code of output column j * N/8 + c; scales and mins f16[K/g, N];
W = q * scale + min. With `shards` = S > 1 each block of N/S columns is packed on its own; the
kernel is written for S = 1 (what every device holds under tensor parallelism, where a column
shard of an S = T weight is an S = 1 weight); given S > 1 on one device the wrapper slices the
layer out, puts scales/mins in packed order and the output back in column order (a correct path,
not the fast one).

The implementation is a static choice of the caller, `impl=`: 'pallas' (this kernel, GPU),
'pallas_interpret' (the same kernel interpreted, for CPU tests), 'xla' (unpack + dot, any backend)
or 'reference'. Nothing here reads `jax.default_backend()`: the engine picks once, when it is built.

Stacked layers: given `layer`, the weight arrays are a model's whole stack [L, ...] and the kernel
reads layer `layer` (a traced index) in place, as the paged-attention kernels read the KV pool.
Inside the model's `lax.scan` over layers this spares a copy: a custom call's operand must be a
buffer of its own, so handing the kernel `packed[l]` makes XLA write that layer's slice out (and
the kernel read it back) every layer of every step, unless XLA's dynamic-slice fusion absorbs it.
Tiled (a mixture of experts' grouped matmul, `tiles.py`): `layer` i32[T] and `tile_rows` b: row
block t (block_m = b) reads layer layer[t], and a block whose index is negative writes zeros
without reading the weight.

Dataflow of `int4_matmul` (N8 = N/8 packed columns, G = K/g groups, S = split-K factor):

    x [M, K]; packed [L, K, N8] -> [L*K, N8]; scales, mins [L, G, N] -> [L*G, 8, N8]
        (free reshapes: plane j = columns j*N8 ..; L = 1 for one layer's weight, layer l = 0)
    grid (M/bm, N8/bc, S): program (i, c, s) loops over its G/S groups; per group t:
        xg  = x[i-block, t*g:(t+1)*g]                      (bm, g)   rows >= M masked to 0
        rs  = sum_k xg                                     (bm, 1)   f32
        p   = packed[l*K + t*g : l*K + (t+1)*g, c-block]   (g, bc)   u32, one load for 8 planes
        for plane j in 0..7:
            q_j = (p >> 4j) & 15                           (g, bc)   exact in bf16/f32
            acc_j += (xg @ q_j) * scales[l*G + t, j, c] + rs * mins[l*G + t, j, c]   (bm, bc)
    out [S, M, 8, N8] (f32 partials when S > 1) -> sum over S -> [M, N] (a free reshape)

The scale and min factor out of each group's dot because they are constant along k within a group,
so the weight is never dequantized element by element: per element the kernel does one shift, one
mask and one convert. Decode batch sizes (M <= 64) run as a GEMV-like split-K launch (bm = 16
rows per program, padded by masking for tl.dot's M >= 16) with S chosen so the grid fills the
H200's 132 SMs about twice; prefill (M > 64) runs tiled with S = 1 (no partial-output traffic):
`int4_plan.py` picks the tiles.

Dimensions need not be powers of two (SmolLM2: K, N in {576, 192, 1536}): every load/store is a
power-of-two tile of a whole-array ref at a dynamic offset, and the ragged last column block and
rows past M are masked (Triton does no bounds checks of its own). K must be a multiple of g
(enforced by the layout), N a multiple of 8. Row indices (l*K + k, l*G + t) are small int32s; the
element offsets they become are computed by Pallas' Triton lowering, in 64 bits for any array over
4 GiB (a Llama-3-70B MLP stack: 80 x 8192 x 3584 u32 words, 9.4 GB).

`int4_matmul_xla` (unpack + dot; what CPUs run) and `int4_matmul_reference` (pure jnp, f32, the
definition the tests compare against) are at the end of the file.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.int4_layout import (
    PACK,
    check_arrays,
    column_order,
    dequantize_arrays,
    kernel_column_order,
)
from pallas_kernels.int4_plan import Int4MatmulConfig, plan, tiled_plan
from pallas_kernels.lowering import KernelCheck
from pallas_kernels.tiles import check_layer, per_tile

IMPLS = ("pallas", "pallas_interpret", "xla", "reference")
ACT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# ------------------------------------------------------------------------------------------------
# Kernel.


def _kernel(
    layer_ref,  # i32[1] | i32[T]   which layer of the stack (tiled: row block i's is layer_ref[i])
    x_ref,  # [M, K]                activations, whole array
    p_ref,  # u32[L * K, N8]        packed codes of every layer, whole array
    s_ref,  # f16[L * G, 8, N8]     scales by (layer and group, plane, packed column)
    z_ref,  # f16[L * G, 8, N8]     mins
    o_ref,  # [S, M, 8, N8]         output (f32 partials when S > 1, else x.dtype)
    *,
    m: int,
    k: int,
    n8: int,
    group_size: int,
    groups_per_split: int,
    block_m: int,
    block_c: int,
    tiled: bool,
):
    i, c, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    g, bm, bc = group_size, block_m, block_c
    cdt = x_ref.dtype  # codes 0..15 are exact in every activation dtype
    row0, col0 = i * bm, c * bc
    rows_ragged, cols_ragged = m % bm != 0, n8 % bc != 0
    row_ok = row0 + lax.broadcasted_iota(jnp.int32, (bm, 1), 0) < m  # (bm, 1)
    col_ok = col0 + lax.broadcasted_iota(jnp.int32, (1, bc), 1) < n8  # (1, bc)

    def masked_load(ref, mask, shape):
        if mask is None:
            return ref[...]
        return pltriton.load(ref, mask=jnp.broadcast_to(mask, shape), other=0)

    layer = layer_ref[i] if tiled else layer_ref[0]
    groups = k // g

    def body(t, acc):
        gi = s * groups_per_split + t
        k0 = pl.multiple_of(gi * g, g)
        pk0 = pl.multiple_of(layer * k + gi * g, g)  # the layer's rows of the stacked codes
        si = layer * groups + gi
        xg = masked_load(
            x_ref.at[pl.ds(row0, bm), pl.ds(k0, g)], row_ok if rows_ragged else None, (bm, g)
        )  # (bm, g)
        rs = jnp.sum(xg.astype(jnp.float32), axis=1, keepdims=True)  # (bm, 1)
        p = masked_load(
            p_ref.at[pl.ds(pk0, g), pl.ds(col0, bc)], col_ok if cols_ragged else None, (g, bc)
        )  # (g, bc) u32
        out = []
        for j in range(PACK):
            jj = jnp.int32(j)  # an array index: the interpreter rejects Python ints next to slices
            q = ((p >> (4 * j)) & 0xF).astype(jnp.int32).astype(cdt)  # (g, bc)
            mask = col_ok[0] if cols_ragged else None
            sc = masked_load(s_ref.at[si, jj, pl.ds(col0, bc)], mask, (bc,)).astype(jnp.float32)
            mn = masked_load(z_ref.at[si, jj, pl.ds(col0, bc)], mask, (bc,)).astype(jnp.float32)
            d = jnp.dot(xg, q, preferred_element_type=jnp.float32)  # (bm, bc)
            out.append(acc[j] + d * sc[None, :] + rs * mn[None, :])
        return tuple(out)

    init = tuple(jnp.zeros((bm, bc), jnp.float32) for _ in range(PACK))
    run = lambda: lax.fori_loop(0, groups_per_split, body, init)  # noqa: E731
    # a padding tile (negative layer) reads no weight and writes zeros
    acc = lax.cond(layer >= 0, run, lambda: init) if tiled else run()
    mask = None
    if rows_ragged or cols_ragged:
        mask = jnp.broadcast_to(row_ok & col_ok, (bm, bc))
    for j in range(PACK):
        ref = o_ref.at[s, pl.ds(row0, bm), jnp.int32(j), pl.ds(col0, bc)]
        val = acc[j].astype(o_ref.dtype)
        if mask is None:
            ref[...] = val
        else:
            pltriton.store(ref, val, mask=mask)


def _call(
    x2, packed, scales, mins, layer, group_size, cfg: Int4MatmulConfig, interpret: bool, out_dtype
):
    """pallas_call wrapper: x2 [M, K] @ layer `layer` (i32[], or i32[T]: one per row block) of
    packed [L, K, N8] -> [M, N] in out_dtype (shards = 1: output column j*N8 + c is nibble j of
    packed column c)."""
    m, k = x2.shape
    tiled = jnp.ndim(layer) == 1
    layer = jnp.asarray(layer, jnp.int32).reshape(-1)  # (1,) or (T,)
    if tiled and layer.shape[0] * cfg.block_m != m:
        raise ValueError(f"{layer.shape[0]} tiles of block_m={cfg.block_m} rows must cover M={m}")
    n_layers, _, n8 = packed.shape
    groups = k // group_size
    if groups % cfg.splits:
        raise ValueError(f"splits={cfg.splits} must divide the {groups} groups of K={k}")
    final_dtype = out_dtype
    out_dtype = jnp.float32 if cfg.splits > 1 else final_dtype
    whole = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))
    p2 = packed.reshape(n_layers * k, n8)  # (L*K, N8)
    s3 = scales.reshape(n_layers * groups, PACK, n8)  # (L*G, 8, N8): plane j = columns j*N8 ..
    z3 = mins.reshape(n_layers * groups, PACK, n8)
    kernel = functools.partial(
        _kernel,
        m=m,
        k=k,
        n8=n8,
        group_size=group_size,
        groups_per_split=groups // cfg.splits,
        block_m=cfg.block_m,
        block_c=cfg.block_c,
        tiled=tiled,
    )
    grid = (pl.cdiv(m, cfg.block_m), pl.cdiv(n8, cfg.block_c), cfg.splits)
    tag = f"_t{cfg.block_m}" if tiled else ""
    out = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[whole(a.shape) for a in (layer, x2, p2, s3, z3)],
        out_specs=whole((cfg.splits, m, PACK, n8)),
        out_shape=jax.ShapeDtypeStruct((cfg.splits, m, PACK, n8), out_dtype),
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=f"int4_matmul{tag}_g{group_size}_bm{cfg.block_m}_bc{cfg.block_c}_s{cfg.splits}",
    )(layer, x2, p2, s3, z3)
    if cfg.splits > 1:
        out = jnp.sum(out, axis=0)
    else:
        out = out[0]
    return out.reshape(m, PACK * n8).astype(final_dtype)  # (M, 8, N8) -> (M, N): plane-major


@functools.partial(
    jax.jit,
    static_argnames=("group_size", "config", "interpret", "shards", "out_dtype", "tile_rows"),
)
def _pallas_jit(
    x, packed, scales, mins, layer, group_size, config, interpret, shards, out_dtype, tile_rows
):
    *lead, k = x.shape
    x2 = x.reshape(-1, k)  # (M, K)
    n = packed.shape[-1] * PACK
    if tile_rows is not None:
        cfg = config or tiled_plan(x2.shape[0] // tile_rows, tile_rows, k, n, group_size)
        if shards > 1 or cfg.block_m != tile_rows:
            raise ValueError(f"a tiled call needs shards = 1 and block_m = tile_rows={tile_rows}")
    else:
        cfg = config or plan(x2.shape[0], k, n, group_size)
    if shards > 1:  # the kernel's S = 1 order: one layer, scales in packed order (copies)
        packed, scales, mins = (
            lax.dynamic_index_in_dim(a, layer, keepdims=True) for a in (packed, scales, mins)
        )
        scales, mins = (kernel_column_order(a, shards) for a in (scales, mins))
        layer = 0
    out = _call(x2, packed, scales, mins, layer, group_size, cfg, interpret, out_dtype)
    return column_order(out, shards).reshape(*lead, -1)


def int4_matmul(
    x: jax.Array,
    packed: jax.Array,
    scales: jax.Array,
    mins: jax.Array,
    *,
    group_size: int,
    impl: str,
    config: Int4MatmulConfig | None = None,
    layer: jax.Array | int | None = None,
    shards: int = 1,
    out_dtype=None,
    tile_rows: int | None = None,
) -> jax.Array:
    """x[..., K] @ W[K, N] -> [..., N] in out_dtype (default x.dtype), f32 accumulation;
    W = (packed, scales, mins) in the INT4 layout, packed with `shards` column blocks.

    x:       f32/bf16/f16[..., K]
    packed:  u32[K, N/8];  scales, mins: f16[K/g, N]
             with `layer`: a stack u32[L, K, N/8], f16[L, K/g, N], of which layer `layer` is W
    impl:    'pallas' (the fused kernel; GPU), 'pallas_interpret' (it, interpreted; CPU tests),
             'xla' (unpack + dot; any backend) or 'reference' (f32 jnp): a static choice
    config:  tiles for the Pallas kernel (default: `plan` from the shape)
    layer:   i32[] or int (may be traced, e.g. under `lax.scan`): the Pallas kernel reads that
             layer of the stack in place; the XLA and reference paths slice it out
    tile_rows: with `layer` i32[T], a tiled call (`tiles.py`): x [T * tile_rows, K], tile t's
             rows times layer layer[t] (negative: zeros); the kernel runs a tile per row block
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    check_arrays(packed, scales, mins, group_size, shards)
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    want_ndim = 2 if layer is None else 3
    if packed.ndim != want_ndim:
        what = "one layer's u32[K, N/8]" if layer is None else "a stack u32[L, K, N/8] with layer="
        raise ValueError(f"packed must be {what}, got shape {packed.shape}")
    kernel = impl in ("pallas", "pallas_interpret")
    check_layer(x, layer, tile_rows, kernel)
    if tile_rows is not None and shards != 1:
        raise ValueError(f"a tiled call needs the plain packing (shards = 1), got {shards}")
    if jnp.dtype(x.dtype) not in ACT_DTYPES:
        raise ValueError(f"x must be f32/bf16/f16, got {x.dtype}")
    if x.ndim < 1 or x.shape[-1] != packed.shape[-2]:
        raise ValueError(f"x has shape {x.shape}; its last dim must be K={packed.shape[-2]}")
    if kernel:
        if layer is None:  # one layer: a stack of one (free reshapes)
            packed, scales, mins, layer = packed[None], scales[None], mins[None], 0
        interpret = impl == "pallas_interpret"
        return _pallas_jit(
            x,
            packed,
            scales,
            mins,
            layer,
            group_size,
            config,
            interpret,
            shards,
            out_dtype,
            tile_rows,
        )
    if tile_rows is not None:

        def one(rows, li):
            return int4_matmul(
                rows,
                packed,
                scales,
                mins,
                group_size=group_size,
                impl=impl,
                layer=li,
                out_dtype=out_dtype,
            )

        return per_tile(one, x, jnp.asarray(layer, jnp.int32), tile_rows)
    if layer is not None:
        packed, scales, mins = (
            lax.dynamic_index_in_dim(a, layer, keepdims=False) for a in (packed, scales, mins)
        )
    if impl == "xla":
        return int4_matmul_xla(x, packed, scales, mins, group_size, shards, out_dtype)
    return int4_matmul_reference(x, packed, scales, mins, group_size, shards, out_dtype)


def lowering_cases() -> list:
    """CUDA lowering cases for `pallas_kernels.check`: SmolLM2 and Llama-3-8B projections."""

    sds = jax.ShapeDtypeStruct
    shapes = {
        "smollm2": [(576, 576), (576, 192), (576, 1536), (1536, 576)],
        "llama3-8b": [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096)],
    }
    group_sizes = {"smollm2": (32, 64), "llama3-8b": (128, 32)}
    cases = []
    for model, kns in shapes.items():
        for k, n in kns:
            for g in group_sizes[model]:
                for m in (1, 8, 32, 128, 512):
                    args = (
                        sds((m, k), jnp.bfloat16),
                        sds((k, n // PACK), jnp.uint32),
                        sds((k // g, n), jnp.float16),
                        sds((k // g, n), jnp.float16),
                    )
                    fn = functools.partial(int4_matmul, group_size=g, impl="pallas")
                    cases.append(KernelCheck(f"int4_matmul/{model}/{k}x{n}_g{g}_m{m}", fn, args))
    # A model's whole stack of one weight and a traced layer index, as inside its lax.scan.
    stacks = {"smollm2": (30, 576, 1536, 64), "llama3-8b": (32, 14336, 4096, 128)}
    for model, (layers, k, n, g) in stacks.items():
        for m in (8, 512):
            args = (
                sds((m, k), jnp.bfloat16),
                sds((layers, k, n // PACK), jnp.uint32),
                sds((layers, k // g, n), jnp.float16),
                sds((layers, k // g, n), jnp.float16),
                sds((), jnp.int32),
            )

            def fn(x, packed, scales, mins, layer, g=g):
                return int4_matmul(
                    x, packed, scales, mins, group_size=g, impl="pallas", layer=layer
                )

            name = f"int4_matmul/{model}/stack{layers}_{k}x{n}_g{g}_m{m}"
            cases.append(KernelCheck(name, fn, args))
    # A mixture of experts' tiled call (`tiles.py`): Mixtral 8x7B's expert stack (32 layers x 8
    # experts), 16 tiles of 16 rows (64 slots, top-2) and 8 tiles of 128 rows (a prefill chunk).
    for k, n in ((4096, 14336), (14336, 4096)):
        for tiles, rows in ((16, 16), (8, 128)):
            args = (
                sds((tiles * rows, k), jnp.bfloat16),
                sds((256, k, n // PACK), jnp.uint32),
                sds((256, k // 128, n), jnp.float16),
                sds((256, k // 128, n), jnp.float16),
                sds((tiles,), jnp.int32),
            )

            def tiled(x, p, s, m, i, b=rows):
                return int4_matmul(x, p, s, m, group_size=128, impl="pallas", layer=i, tile_rows=b)

            name = f"int4_matmul/mixtral/experts256_{k}x{n}_g128_tiles{tiles}x{rows}"
            cases.append(KernelCheck(name, tiled, args))
    return cases


# ------------------------------------------------------------------------------------------------
# XLA path and reference.


@functools.partial(jax.jit, static_argnames=("group_size", "shards", "out_dtype"))
def int4_matmul_xla(
    x, packed, scales, mins, group_size: int, shards: int = 1, out_dtype=None
) -> jax.Array:
    """Unpack + dot: dequantizes the whole [K, N] weight into x.dtype, then one XLA dot."""
    w = dequantize_arrays(packed, scales, mins, group_size, shards).astype(x.dtype)  # (K, N)
    y = jnp.einsum("...k,kn->...n", x, w, preferred_element_type=jnp.float32)
    return y.astype(out_dtype or x.dtype)


def int4_matmul_reference(
    x, packed, scales, mins, group_size: int, shards: int = 1, out_dtype=None
) -> jax.Array:
    """The definition: x (as f32) @ W (f32, per `int4_layout.dequantize_arrays`) -> out_dtype
    (default x.dtype)."""
    w = dequantize_arrays(packed, scales, mins, group_size, shards)  # (K, N) f32
    y = jnp.einsum("...k,kn->...n", x.astype(jnp.float32), w, precision=lax.Precision.HIGHEST)
    return y.astype(out_dtype or x.dtype)
