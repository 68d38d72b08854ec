"""W8A16 matmul: x[M, K] @ (q * scale)[K, N] for an INT8 or FP8 (e4m3) weight q with one scale per
output column, reading one layer of a stacked [L, K, N] weight in place.

Why it exists: under the model's `lax.scan` over layers, XLA:GPU copies each layer's slice of a
stacked weight into a buffer of its own before a Triton GEMM (the GEMM's operand cannot be a
dynamic slice), and a cuBLAS GEMM cannot read 8-bit weights beside 16-bit activations without XLA
first converting the layer to bf16 in a buffer (two bytes per weight written and read again). This
kernel takes the whole stack and the layer index, as the INT4 kernel (`int4_matmul.py`) and the
paged-attention kernels read their pools, so each weight byte is read once per step.
Tiled (a mixture of experts' grouped matmul, `tiles.py`): `layer` i32[T] and `tile_rows` b: row
block t (block_m = b) reads layer layer[t]; a negative index writes zeros and reads no weight.

The implementation is a static choice of the caller, `impl=`: 'pallas' (this kernel, GPU),
'pallas_interpret' (the same kernel interpreted, for CPU tests), 'xla' (convert + dot, any
backend) or 'reference'. Nothing here reads `jax.default_backend()`.

Dataflow (S = split-K factor, bk = rows of K per iteration):

    x [M, K]; q [L, K, N] -> [L*K, N] (a free reshape); scales f32[L, 1, N] -> [L, N]
    grid (M/bm, N/bn, S): program (i, j, s) loops over its K/(S*bk) blocks; per block t:
        xk  = x[i-block, k0:k0+bk]                      (bm, bk)   rows >= M masked to 0
        w   = q[l*K + k0 : l*K + k0 + bk, j-block]      (bk, bn)   int8 / e4m3 -> x.dtype (exact)
        acc += xk @ w                                    (bm, bn)   f32
        then acc * scales[l, j-block]              (the scale factors out of every partial sum)
    out [S, M, N] f32 -> sum over S -> x.dtype

Per-channel scales factor out of the dot, so the weight is only converted (exactly: every int8 and
e4m3 value is a bf16) and never scaled element by element. Decode batches (M <= 64) run split-K
so that the grid fills the GPU's SMs about twice; `plan` picks the tiles. Every load is a
power-of-two tile at a dynamic offset; a ragged last column block and rows past M are masked.

`w8_matmul_xla` (convert + dot: what CPUs run) and `w8_matmul_reference` (pure jnp, f32, the
definition the tests compare against) are at the end of the file.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.lowering import KernelCheck
from pallas_kernels.tiles import check_layer, per_tile

IMPLS = ("pallas", "pallas_interpret", "xla", "reference")
ACT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
WEIGHT_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
NUM_SMS = 132  # H100 SXM and H200


@dataclasses.dataclass(frozen=True)
class W8MatmulConfig:
    """One launch's tiles: block_m rows, block_n columns, block_k rows of K a step, splits."""

    block_m: int
    block_n: int
    block_k: int
    splits: int
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for f in ("block_m", "block_n", "block_k", "num_warps"):
            v = getattr(self, f)
            if v <= 0 or v & (v - 1):
                raise ValueError(f"W8MatmulConfig.{f} must be a positive power of two, got {v}")
        if min(self.block_m, self.block_n, self.block_k) < 16:
            raise ValueError("W8MatmulConfig blocks must be >= 16 (tl.dot tiles)")
        if self.splits <= 0 or self.num_stages <= 0:
            raise ValueError("W8MatmulConfig.splits and num_stages must be positive")


def plan(m: int, k: int, n: int, num_sms: int = NUM_SMS) -> W8MatmulConfig:
    """Tiles for x[m, k] @ W[k, n] (a heuristic, to be timed on the GPU: experiments/gpu_checks.sh).

    block_k: the largest power of two <= 128 dividing K (at least 16). Decode (m <= 64): the
    smallest power-of-two row block >= 16 covering m, 64 columns, split-K over the K blocks until
    the grid has ~2 programs per SM. Larger m: 64 x 64 tiles, no split."""
    block_k = next((b for b in (128, 64, 32, 16) if k % b == 0), None)
    if block_k is None:
        raise ValueError(f"K={k} must be a multiple of 16")
    block_n = 64
    if m > 64:
        return W8MatmulConfig(64, block_n, block_k, 1)
    block_m = max(16, 1 << max(0, m - 1).bit_length())
    programs = -(-m // block_m) * -(-n // block_n)
    return W8MatmulConfig(block_m, block_n, block_k, _splits(k // block_k, programs, num_sms))


def _splits(steps: int, programs: int, num_sms: int) -> int:
    """Split-K over the K blocks (a divisor of their count, at most 32) until the grid has ~2
    programs per SM."""
    splits = next(
        (d for d in range(1, steps + 1) if steps % d == 0 and programs * d >= 2 * num_sms), steps
    )
    return max(d for d in range(1, min(splits, 32) + 1) if steps % d == 0)


# ------------------------------------------------------------------------------------------------
# Kernel.


def _kernel(
    layer_ref,  # i32[1] | i32[T]  which layer of the stack (tiled: row block i's is layer_ref[i])
    x_ref,  # [M, K]               activations, whole array
    q_ref,  # i8|f8[L * K, N]      every layer's weight, whole array
    s_ref,  # f32[L, N]            every layer's per-column scales
    o_ref,  # f32[S, M, N]         scaled partial sums (summed over S by XLA)
    *,
    m: int,
    k: int,
    n: int,
    steps_per_split: int,
    block_m: int,
    block_n: int,
    block_k: int,
    tiled: bool,
):
    i, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bm, bn, bk = block_m, block_n, block_k
    cdt = x_ref.dtype  # every int8 and e4m3 value is exact in bf16, f16 and f32
    row0, col0 = i * bm, j * bn
    rows_ragged, cols_ragged = m % bm != 0, n % bn != 0
    row_ok = row0 + lax.broadcasted_iota(jnp.int32, (bm, 1), 0) < m  # (bm, 1)
    col_ok = col0 + lax.broadcasted_iota(jnp.int32, (1, bn), 1) < n  # (1, bn)

    def masked_load(ref, mask, shape):
        if mask is None:
            return ref[...]
        return pltriton.load(ref, mask=jnp.broadcast_to(mask, shape), other=0)

    layer = layer_ref[i] if tiled else layer_ref[0]

    def body(t, acc):
        k0 = pl.multiple_of((s * steps_per_split + t) * bk, bk)
        xk = masked_load(
            x_ref.at[pl.ds(row0, bm), pl.ds(k0, bk)], row_ok if rows_ragged else None, (bm, bk)
        )  # (bm, bk)
        qk0 = pl.multiple_of(layer * k + k0, bk)  # the layer's rows of the stacked weight
        w = masked_load(
            q_ref.at[pl.ds(qk0, bk), pl.ds(col0, bn)], col_ok if cols_ragged else None, (bk, bn)
        )  # (bk, bn)
        return acc + jnp.dot(xk, w.astype(cdt), preferred_element_type=jnp.float32)

    def run():
        acc = lax.fori_loop(0, steps_per_split, body, jnp.zeros((bm, bn), jnp.float32))
        mask = col_ok[0] if cols_ragged else None
        scale = masked_load(s_ref.at[layer, pl.ds(col0, bn)], mask, (bn,))
        return acc * scale[None, :]  # (bm, bn): the scale factors out of each partial sum too

    # a padding tile (negative layer) reads no weight and writes zeros
    acc = lax.cond(layer >= 0, run, lambda: jnp.zeros((bm, bn), jnp.float32)) if tiled else run()
    ref = o_ref.at[s, pl.ds(row0, bm), pl.ds(col0, bn)]
    if rows_ragged or cols_ragged:
        pltriton.store(ref, acc, mask=jnp.broadcast_to(row_ok & col_ok, (bm, bn)))
    else:
        ref[...] = acc


def tiled_plan(num_tiles: int, tile_rows: int, k: int, n: int, num_sms: int = NUM_SMS):
    """Tiles of a tiled call (`tiles.py`): one row block per tile (block_m = tile_rows), `plan`'s
    columns and K blocks, split-K as at decode for decode-sized tiles (<= 64 rows), none above."""
    base = plan(min(tile_rows, 64), k, n, num_sms)
    if tile_rows > 64:
        return W8MatmulConfig(tile_rows, base.block_n, base.block_k, 1)
    programs = num_tiles * -(-n // base.block_n)
    splits = _splits(k // base.block_k, programs, num_sms)
    return W8MatmulConfig(tile_rows, base.block_n, base.block_k, splits)


@functools.partial(jax.jit, static_argnames=("config", "interpret", "out_dtype", "tile_rows"))
def _pallas_jit(x, q, scales, layer, config, interpret, out_dtype, tile_rows):
    *lead, k = x.shape
    x2 = x.reshape(-1, k)  # (M, K)
    m = x2.shape[0]
    n_layers, _, n = q.shape
    tiled = tile_rows is not None
    if tiled:
        cfg = config or tiled_plan(m // tile_rows, tile_rows, k, n)
        if cfg.block_m != tile_rows:
            raise ValueError(f"a tiled call needs block_m = tile_rows={tile_rows}")
    else:
        cfg = config or plan(m, k, n)
    steps = k // cfg.block_k
    if k % cfg.block_k or steps % cfg.splits:
        raise ValueError(f"block_k={cfg.block_k} x splits={cfg.splits} must divide K={k}")
    kernel = functools.partial(
        _kernel,
        m=m,
        k=k,
        n=n,
        steps_per_split=steps // cfg.splits,
        block_m=cfg.block_m,
        block_n=cfg.block_n,
        block_k=cfg.block_k,
        tiled=tiled,
    )
    whole = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))
    q2 = q.reshape(n_layers * k, n)  # (L*K, N)
    s2 = scales.reshape(n_layers, n)  # (L, N)
    grid = (pl.cdiv(m, cfg.block_m), pl.cdiv(n, cfg.block_n), cfg.splits)
    layer = jnp.asarray(layer, jnp.int32).reshape(-1)  # (1,) or (T,)
    tag = f"_t{cfg.block_m}" if tiled else ""
    out = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[whole(layer.shape), whole((m, k)), whole(q2.shape), whole(s2.shape)],
        out_specs=whole((cfg.splits, m, n)),
        out_shape=jax.ShapeDtypeStruct((cfg.splits, m, n), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=f"w8_matmul{tag}_bm{cfg.block_m}_bn{cfg.block_n}_bk{cfg.block_k}_s{cfg.splits}",
    )(layer, x2, q2, s2)
    return jnp.sum(out, axis=0).astype(out_dtype).reshape(*lead, n)  # (M, N)


def w8_matmul(
    x: jax.Array,
    q: jax.Array,
    scales: jax.Array,
    *,
    impl: str,
    config: W8MatmulConfig | None = None,
    layer: jax.Array | int | None = None,
    out_dtype=None,
    tile_rows: int | None = None,
) -> jax.Array:
    """x[..., K] @ (q * scales)[K, N] -> [..., N] in out_dtype (default x.dtype), f32 accumulation.

    x:       f32/bf16/f16[..., K]
    q:       int8 or float8_e4m3fn [K, N]; scales f32[1, N] (one per output column)
             with `layer`: stacks q[L, K, N], scales f32[L, 1, N], of which layer `layer` is W
    impl:    'pallas' (the kernel; GPU), 'pallas_interpret' (it, interpreted; CPU tests),
             'xla' (convert + dot; any backend) or 'reference' (f32 jnp): a static choice
    config:  tiles for the Pallas kernel (default: `plan` from the shape)
    layer:   i32[] or int (may be traced, e.g. under `lax.scan`): the kernel reads that layer
             of the stack in place; the XLA and reference paths slice it out
    tile_rows: with `layer` i32[T], a tiled call (`tiles.py`): x [T * tile_rows, K], tile t's
             rows times layer layer[t] (negative: zeros); the kernel runs a tile per row block
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if jnp.dtype(q.dtype) not in WEIGHT_DTYPES:
        raise ValueError(f"q must be int8 or float8_e4m3fn, got {q.dtype}")
    want_ndim = 2 if layer is None else 3
    if q.ndim != want_ndim:
        what = "one layer's [K, N]" if layer is None else "a stack [L, K, N] with layer="
        raise ValueError(f"q must be {what}, got shape {q.shape}")
    if tuple(scales.shape) != (*q.shape[:-2], 1, q.shape[-1]) or scales.dtype != jnp.float32:
        raise ValueError(
            f"scales must be f32{[*q.shape[:-2], 1, q.shape[-1]]} (one per output column), "
            f"got {scales.dtype}{list(scales.shape)}"
        )
    kernel = impl in ("pallas", "pallas_interpret")
    check_layer(x, layer, tile_rows, kernel)
    if jnp.dtype(x.dtype) not in ACT_DTYPES:
        raise ValueError(f"x must be f32/bf16/f16, got {x.dtype}")
    if x.ndim < 1 or x.shape[-1] != q.shape[-2]:
        raise ValueError(f"x has shape {x.shape}; its last dim must be K={q.shape[-2]}")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if kernel:
        if layer is None:  # one layer: a stack of one (free reshapes)
            q, scales, layer = q[None], scales[None], 0
        interpret = impl == "pallas_interpret"
        return _pallas_jit(x, q, scales, layer, config, interpret, out_dtype, tile_rows)
    if tile_rows is not None:

        def one(rows, li):
            return w8_matmul(rows, q, scales, impl=impl, layer=li, out_dtype=out_dtype)

        return per_tile(one, x, jnp.asarray(layer, jnp.int32), tile_rows)
    if layer is not None:
        q, scales = (lax.dynamic_index_in_dim(a, layer, keepdims=False) for a in (q, scales))
    if impl == "xla":
        return w8_matmul_xla(x, q, scales, out_dtype)
    return w8_matmul_reference(x, q, scales, out_dtype)


def lowering_cases() -> list:
    """CUDA lowering cases for `pallas_kernels.check`: SmolLM2 and Llama-3-8B projections, one
    weight and a model's whole stack with a traced layer index (as inside its lax.scan)."""
    sds = jax.ShapeDtypeStruct
    shapes = {
        "smollm2": (30, [(576, 576), (576, 192), (576, 1536), (1536, 576)]),
        "llama3-8b": (32, [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096)]),
    }
    cases = []
    for model, (layers, kns) in shapes.items():
        for k, n in kns:
            for dtype in WEIGHT_DTYPES:
                for m in (1, 8, 64, 512):
                    args = (sds((m, k), jnp.bfloat16), sds((k, n), dtype), sds((1, n), jnp.float32))
                    fn = functools.partial(w8_matmul, impl="pallas")
                    cases.append(
                        KernelCheck(f"w8_matmul/{model}/{dtype.name}/{k}x{n}_m{m}", fn, args)
                    )
            args = (
                sds((8, k), jnp.bfloat16),
                sds((layers, k, n), jnp.int8),
                sds((layers, 1, n), jnp.float32),
                sds((), jnp.int32),
            )

            def stacked(x, q, scales, layer):
                return w8_matmul(x, q, scales, impl="pallas", layer=layer)

            cases.append(KernelCheck(f"w8_matmul/{model}/stack{layers}_{k}x{n}_m8", stacked, args))
    # A mixture of experts' tiled call (`tiles.py`): Mixtral 8x7B's expert stack (32 layers x 8
    # experts), 16 tiles of 16 rows (64 slots, top-2) and 8 tiles of 128 rows (a prefill chunk).
    for k, n in ((4096, 14336), (14336, 4096)):
        for tiles, rows in ((16, 16), (8, 128)):
            args = (
                sds((tiles * rows, k), jnp.bfloat16),
                sds((256, k, n), jnp.float8_e4m3fn),
                sds((256, 1, n), jnp.float32),
                sds((tiles,), jnp.int32),
            )

            def tiled(x, q, scales, layer, rows=rows):
                return w8_matmul(x, q, scales, impl="pallas", layer=layer, tile_rows=rows)

            name = f"w8_matmul/mixtral/experts256_{k}x{n}_tiles{tiles}x{rows}"
            cases.append(KernelCheck(name, tiled, args))
    return cases


# ------------------------------------------------------------------------------------------------
# XLA path and reference.


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def w8_matmul_xla(x, q, scales, out_dtype=None) -> jax.Array:
    """Convert + dot: (x @ q.astype(x.dtype)) * scales, f32 accumulation."""
    y = jnp.einsum("...k,kn->...n", x, q.astype(x.dtype), preferred_element_type=jnp.float32)
    return (y * scales[0]).astype(out_dtype or x.dtype)


def w8_matmul_reference(x, q, scales, out_dtype=None) -> jax.Array:
    """The definition: x (as f32) @ (q * scales) (f32) -> out_dtype (default x.dtype)."""
    w = q.astype(jnp.float32) * scales
    y = jnp.einsum("...k,kn->...n", x.astype(jnp.float32), w, precision=lax.Precision.HIGHEST)
    return y.astype(out_dtype or x.dtype)
