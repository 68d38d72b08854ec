"""W8A16 matmul on Pallas Mosaic GPU (Hopper: TMA + wgmma), the successor of the Triton
`w8_matmul` (jax 0.11 deprecates the Pallas Triton backend).

x[M, K] bf16 @ (q * scale)[K, N] for an INT8 or FP8 (e4m3) weight q with one f32 scale per output
column, reading layer `layer` (traced) of a stacked [L, K, N] weight in place: the semantics of
`w8_matmul.w8_matmul(..., impl="pallas")`. Dataflow of `w8_matmul_mgpu` (R = rows a program
computes, BN x BK = weight tile, S = split-K factor, NBUF = ring slots):

    x [M, K] -> [Mp, K]            rows zero-padded to a multiple of 8 (M <= 64: R = Mp, one row
                                   block) or of 64 (M > 64: R = 64); a small copy of x, never of q
    q [L, K, N] -> [L*K, N]        a free reshape; scales f32[L, 1, N] -> [L, N]
    grid (Mp/R, N/BN, S), one warpgroup per program (i, j, s), which walks its K/(S*BK)
    tiles t (rows k0 = (s * K/(S*BK) + t) * BK of this layer):
        x tile [R, BK] bf16        TMA -> rows 0..R of slot t % NBUF of an SMEM ring [NBUF, 64, BK]
        w tile [BK, BN] int8/fp8   TMA from q2[layer*K + k0 : +BK, j-block] (the traced layer
                                   offset is a TMA coordinate: no slice of the stack is copied)
                                   -> slot t % NBUF of an SMEM ring [NBUF, BK, BN]; one barrier per
                                   slot, arrived on by both copies; tile t + NBUF is issued once
                                   tile t's product is done, so NBUF - 1 tiles are in flight while
                                   one is computed
        w -> registers -> bf16     (exact: every int8 and e4m3 value is a bf16; registers in the
                                   WGMMA_8BIT layout: 8-byte SMEM loads) -> one bf16 SMEM tile
                                   [BK, BN] the product reads (wgmma's B comes from SMEM only)
        acc += x_slot @ w_bf16     wgmma [64, BK] x [BK, BN] -> f32 [64, BN] (rows R..64 of the
                                   slot hold whatever was there: they only feed output rows that
                                   are never stored)
    acc * scales[layer, j-block]   (f32 [BN], TMA -> SMEM; the scale factors out of the dot and of
                                   every split's partial sum)
    rows 0..R of acc -> SMEM -> TMA -> out f32[S, Mp, N]; XLA sums over S, drops the padded rows
    and casts to out_dtype

Decode batches (M <= 64) run as one row block of a wgmma M tile of 64: decode is memory-bound, so
the idle rows cost tensor-core cycles, not bandwidth; only the R real rows of x are copied. Split-K
(`plan`) multiplies the programs until about two per SM run (two blocks fit in an SM's SMEM with
the default two ring slots). BN is 128 where it divides N, else 64: Mosaic GPU's tiled TMA
copies need the GMEM array's minor dimension to be a multiple of the SMEM tile's swizzled width
(128 int8 columns for BN = 128, 64 for BN = 64), so there is no ragged column block. (The
interpreter would run one, with TMA's zero fill and clipped stores; the compiler refuses it.)

Refused with a ValueError (`check_mgpu_w8_inputs`; the Triton kernel, `w8_matmul_xla` or the
reference serve them): activations other than bf16 (wgmma multiplies f32 only as tf32, short of
the f32 kernels' accuracy), weights other than int8 / float8_e4m3fn, K not a multiple of 64 (the
swizzled 128-byte rows of a bf16 x tile), N not a multiple of 64 (or of a config's block_n), and a
config whose SMEM exceeds the 227 KiB of a Hopper block.

Interpret mode (CPU): `interpret=True` runs the kernel in Mosaic GPU's interpreter
(`plgpu.InterpretGPUParams()`, passed as `plgpu.kernel(interpret=...)`), which simulates SMEM, TMA
copies (zero fill and clipping included), barriers and wgmma. It is laxer than the compiler: the
deviceless H100 compile in the tests is what holds the kernel to what Mosaic GPU lowers (Mosaic GPU
has no e4m3 -> bf16 conversion for sm_90 with ptxas 12.9, for one: the kernel converts e4m3 -> f16
(cvt.rn.f16x2.e4m3x2) -> bf16 (through f32 in the PTX); int8 -> bf16 is a prmt/and/sub trick).
Lowering semantics: Warpgroup (jax's default), one warpgroup per block, no warp specialization;
each step waits for its wgmma before refilling the slot. At the Llama-3-8B decode shapes (8 rows, K x N
4096 x 14336 and 14336 x 4096) ptxas reports 157 registers (int8) / 163 (fp8), no spills
(sm_90a); block_n 256 spills 84 bytes.

The tiles are an `MgpuW8Config` (`mgpu_tuning`). `reference` (= `w8_matmul.w8_matmul_reference`)
is the pure-jnp definition the tests hold the kernel to.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mgpu_common import ROWS, SMEM_BYTES, row_blocks, split_k, tiled_smem
from pallas_kernels.mgpu_tuning import H100_MGPU_W8, MgpuW8Config
from pallas_kernels.w8_matmul import WEIGHT_DTYPES, w8_matmul_reference


@dataclasses.dataclass(frozen=True)
class _Plan:
    rows: int  # R: rows of x a program computes (a multiple of 8, <= 64)
    padded_m: int  # Mp: rows of the padded x and of the output
    block_n: int
    block_k: int
    splits: int
    num_buffers: int


def plan(m: int, k: int, n: int, config: MgpuW8Config = H100_MGPU_W8) -> _Plan:
    """Rows, tiles and split-K of x[m, k] @ W[k, n] (a heuristic, to be timed on a GPU).

    Rows: m rounded up to 8 in one row block (m <= 64), else to 64 in blocks of 64. block_n: the
    config's, or 128 where it divides n, else 64. block_k: the config's if it divides k, else 64.
    Splits: the config's, or the smallest divisor of the K steps that brings the grid to
    `target_programs` (at most `max_splits`; else the largest divisor under it)."""
    rows, padded_m = row_blocks(m, ROWS)
    block_n = config.block_n or (128 if n % 128 == 0 else 64)
    block_k = config.block_k if k % config.block_k == 0 else 64
    steps = k // block_k
    programs = padded_m // rows * -(-n // block_n)
    splits = split_k(steps, programs, config.splits, config.target_programs, config.max_splits)
    return _Plan(rows, padded_m, block_n, block_k, splits, config.num_buffers)


def _smem_bytes(p: _Plan, w_itemsize: int = 1) -> int:
    """SMEM of the loop scope (the output scope after it reuses it; it is smaller)."""
    ring = p.num_buffers * (ROWS * p.block_k * 2 + p.block_k * p.block_n * w_itemsize)
    return ring + p.block_k * p.block_n * 2 + p.block_n * 4  # + the bf16 tile, the scales


# ------------------------------------------------------------------------------------------------
# Kernel.


def _kernel(
    layer_ref,  # i32[1]            GMEM: which layer of the stack
    x_ref,  # bf16[Mp, K]           GMEM
    q_ref,  # i8|f8[L * K, N]       GMEM: every layer's weight
    s_ref,  # f32[L, N]             GMEM: every layer's per-column scales
    o_ref,  # f32[S, Mp, N]         GMEM: scaled partial sums (summed over S by XLA)
    *,
    k: int,
    p: _Plan,
    steps: int,
):
    i, j, s = lax.axis_index("m"), lax.axis_index("n"), lax.axis_index("s")
    rows, bn, bk, nbuf = p.rows, p.block_n, p.block_k, p.num_buffers
    cdt = x_ref.dtype  # bf16: the product's operand dtype
    layer = layer_ref[0]
    row0, col0 = i * rows, j * bn
    k_first = s * (steps * bk)  # this split's first row of K
    q_first = layer * k + k_first  # ... and its row in the stacked weight

    def loop_scope(x_smem, wq_smem, w_smem, s_smem, bars, s_bar):
        def issue(t):
            """TMA copies of step t's x and weight tiles into ring slot t % nbuf."""
            slot = lax.rem(t, nbuf)
            x_dst = x_smem.at[slot] if rows == ROWS else x_smem.at[slot, pl.ds(0, rows)]
            x_src = x_ref.at[pl.ds(row0, rows), pl.ds(k_first + t * bk, bk)]
            plgpu.copy_gmem_to_smem(x_src, x_dst, bars.at[slot])
            w_src = q_ref.at[pl.ds(q_first + t * bk, bk), pl.ds(col0, bn)]
            plgpu.copy_gmem_to_smem(w_src, wq_smem.at[slot], bars.at[slot])

        plgpu.copy_gmem_to_smem(s_ref.at[layer, pl.ds(col0, bn)], s_smem, s_bar)
        for t in range(min(nbuf, steps)):  # prologue: the ring's first tiles in flight
            issue(jnp.int32(t))

        def acc_scope(acc_ref):
            def body(t, carry):
                slot = lax.rem(t, nbuf)
                plgpu.barrier_wait(bars.at[slot])
                w = plgpu.load(wq_smem.at[slot], layout=plgpu.Layout.WGMMA_8BIT)
                if w.dtype == jnp.float8_e4m3fn:  # no e4m3 -> bf16 cvt on sm_90 (ptxas 12.9)
                    w = w.astype(jnp.float16)  # one cvt per two values; exact, as is f16 -> bf16
                w_smem[...] = w.astype(cdt)  # exact: int8 and e4m3 values are bf16 values
                plgpu.commit_smem()  # generic-proxy stores visible to wgmma's async proxy
                plgpu.wgmma(acc_ref, x_smem.at[slot], w_smem)
                plgpu.wgmma_wait(0)  # the slot and the bf16 tile are free again

                @pl.when(t + nbuf < steps)
                def _():
                    issue(t + nbuf)

                return carry

            lax.fori_loop(0, steps, body, None)
            return acc_ref[...]

        acc = pl.run_scoped(acc_scope, plgpu.ACC((ROWS, bn), jnp.float32))
        plgpu.barrier_wait(s_bar)
        scale = plgpu.load(s_smem, layout=plgpu.Layout.WGMMA.reduce(0))
        return acc * lax.broadcast_in_dim(scale, (ROWS, bn), [1])

    acc = pl.run_scoped(
        loop_scope,
        tiled_smem((nbuf, ROWS, bk), cdt),
        tiled_smem((nbuf, bk, bn), q_ref.dtype),
        tiled_smem((bk, bn), cdt),
        plgpu.SMEM((bn,), jnp.float32),
        # one barrier per ring slot, arrived on by its x and weight copies
        plgpu.Barrier(num_arrivals=2, num_barriers=nbuf),
        plgpu.Barrier(),
    )

    def store_scope(o_smem):
        o_smem[...] = acc
        plgpu.commit_smem()
        src = o_smem if rows == ROWS else o_smem.at[pl.ds(0, rows)]
        plgpu.copy_smem_to_gmem(src, o_ref.at[s, pl.ds(row0, rows), pl.ds(col0, bn)])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(store_scope, tiled_smem((ROWS, bn), jnp.float32))


@functools.partial(jax.jit, static_argnames=("config", "interpret", "out_dtype"))
def _mgpu_call(x, q, scales, layer, config, interpret, out_dtype):
    """Jitted Mosaic GPU kernel wrapper: x [..., K] -> [..., N]."""
    *lead, k = x.shape
    x2 = x.reshape(-1, k)  # (M, K)
    m = x2.shape[0]
    n_layers, _, n = q.shape
    p = plan(m, k, n, config)
    steps = k // p.block_k
    x2 = jnp.pad(x2, ((0, p.padded_m - m), (0, 0)))  # (Mp, K)
    kernel = functools.partial(_kernel, k=k, p=p, steps=steps // p.splits)
    grid = (p.padded_m // p.rows, n // p.block_n, p.splits)
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((p.splits, p.padded_m, n), jnp.float32),
        grid=grid,
        grid_names=("m", "n", "s"),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name=f"mgpu_w8_matmul_r{p.rows}_bn{p.block_n}_bk{p.block_k}_s{p.splits}",
    )(
        jnp.asarray(layer, jnp.int32).reshape(1),
        x2,
        q.reshape(n_layers * k, n),  # a bitcast, not a copy
        scales.reshape(n_layers, n),
    )
    return jnp.sum(out, axis=0)[:m].astype(out_dtype).reshape(*lead, n)


def check_mgpu_w8_inputs(x, q, scales, layer, config: MgpuW8Config) -> None:
    """Raises ValueError naming what the Mosaic GPU kernel does not support or what is malformed."""
    if jnp.dtype(x.dtype) != jnp.bfloat16:
        raise ValueError(
            f"w8_matmul_mgpu supports bf16 activations only (wgmma bf16 x bf16 -> f32), got "
            f"{x.dtype}; f32/f16 models use the Triton kernel, w8_matmul_xla or the reference"
        )
    if jnp.dtype(q.dtype) not in WEIGHT_DTYPES:
        raise ValueError(f"w8_matmul_mgpu: q must be int8 or float8_e4m3fn, got {q.dtype}")
    want_ndim = 2 if layer is None else 3
    if q.ndim != want_ndim:
        what = "one layer's [K, N]" if layer is None else "a stack [L, K, N] with a layer"
        raise ValueError(f"w8_matmul_mgpu: q must be {what}, got shape {q.shape}")
    if tuple(scales.shape) != (*q.shape[:-2], 1, q.shape[-1]) or scales.dtype != jnp.float32:
        raise ValueError(
            f"w8_matmul_mgpu: scales must be f32{[*q.shape[:-2], 1, q.shape[-1]]} (one per "
            f"output column), got {scales.dtype}{list(scales.shape)}"
        )
    if layer is not None and jnp.ndim(layer) != 0:
        raise ValueError(f"w8_matmul_mgpu: layer must be a scalar index, got {jnp.shape(layer)}")
    k, n = q.shape[-2:]
    if x.ndim < 1 or x.shape[-1] != k:
        raise ValueError(f"w8_matmul_mgpu: x has shape {x.shape}; its last dim must be K={k}")
    if k % 64:
        raise ValueError(
            f"w8_matmul_mgpu: K={k} must be a multiple of 64 (128-byte swizzled bf16 x rows)"
        )
    if n % (config.block_n or 64):
        raise ValueError(
            f"w8_matmul_mgpu: N={n} must be a multiple of {config.block_n or 64} (TMA copies of "
            "swizzled SMEM tiles need whole tiles of the array's columns)"
        )
    m = 1
    for d in x.shape[:-1]:
        m *= d
    p = plan(m, k, n, config)
    need = _smem_bytes(p, jnp.dtype(q.dtype).itemsize)
    if need > SMEM_BYTES:
        raise ValueError(
            f"w8_matmul_mgpu: {need} bytes of SMEM (block_n {p.block_n}, block_k "
            f"{p.block_k}, {p.num_buffers} buffers) exceed {SMEM_BYTES}"
        )
    if (k // p.block_k) % p.splits:
        raise ValueError(
            f"w8_matmul_mgpu: splits={p.splits} must divide the {k // p.block_k} K steps "
            f"(K={k}, block_k={p.block_k})"
        )


def w8_matmul_mgpu(
    x: jax.Array,
    q: jax.Array,
    scales: jax.Array,
    layer: jax.Array | int | None,
    *,
    out_dtype=None,
    config: MgpuW8Config | None = None,
    interpret: bool = False,
) -> jax.Array:
    """x[..., K] @ (q * scales)[K, N] -> [..., N] in out_dtype (default x.dtype), f32 accumulation
    (Mosaic GPU, Hopper).

    x:       bf16[..., K]
    q:       int8 or float8_e4m3fn stack [L, K, N], scales f32[L, 1, N] (one per output column),
             of which layer `layer` is W; with layer=None, one layer's q [K, N], scales f32[1, N]
    layer:   i32[] or int (may be traced, e.g. under `lax.scan`): read in place from the stack
    config:  an `MgpuW8Config` (default `H100_MGPU_W8`; `plan` picks the splits)
    interpret: run Mosaic GPU's interpreter (CPU tests)

    Raises ValueError for what `check_mgpu_w8_inputs` names (non-bf16 x among them).
    """
    config = config or H100_MGPU_W8
    check_mgpu_w8_inputs(x, q, scales, layer, config)
    if layer is None:  # one layer: a stack of one (free reshapes)
        q, scales, layer = q[None], scales[None], 0
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    layer = jnp.asarray(layer, jnp.int32).reshape(())
    return _mgpu_call(x, q, scales, layer, config, interpret, out_dtype)


reference = w8_matmul_reference
"""The pure-jnp definition the kernel is held to: `w8_matmul.w8_matmul_reference`, x (as f32) @
(q * scales) in f32 for one layer's q [K, N] and scales f32[1, N] (slice a stack's layer first)."""
