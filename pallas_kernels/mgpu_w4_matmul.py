"""W4A16 matmul on Pallas Mosaic GPU (Hopper: TMA + wgmma), the successor of the Triton
`int4_matmul` (jax 0.11 deprecates the Pallas Triton backend).

x[M, K] bf16 @ W[K, N], W in the packed INT4 layout (`int4_layout.py`: packed u32[K, N8], N8 =
N/8, nibble j of packed column c codes output column j*N8 + c; scales, mins f16[K/g, N]; W =
q * scale + min), reading layer `layer` (traced) of a stack [L, ...] in place: the semantics of
`int4_matmul.int4_matmul(..., impl="pallas")` for shards = 1. Dataflow (R = rows a program
computes, BC = its packed columns (8 * BC outputs), BK = rows of K a step, S = split-K factor,
NBUF = ring slots, G = K/g groups, ng = max(1, BK/g) groups a step):

    x [M, K] -> [Mp, K]              rows zero-padded to 8 (M <= 64: R = Mp) or 64 (R = 64)
    packed [L, K, N8] -> [L*K, N8]   free reshapes; scales, mins [L, G, N] -> [L*G, 8, N8]
    grid (Mp/R, N8/BC, S), one warpgroup per program (i, c, s), which walks its K/(S*BK) steps t:
        x [R, BK] bf16, p [BK, BC] u32, scales and mins [ng, 8, BC] f16 (all 8 planes of the
            program's columns): TMA into ring slot t % NBUF, one barrier a slot; the traced layer
            is a TMA coordinate (rows layer*K + k0, layer*G + k0/g): nothing of the stack is copied
        16*scale, min - 16*scale -> f32 SMEM, once a step by the warpgroup (2 values a thread)
        per 64-row block of p: p -> registers (WGMMA layout, u32 [64, BC]); per plane j:
            f = bits(((p >> 4j) & 15) << 19 | 0x3F800000)   = 1 + q/16 in f32, exact (no I2F)
            w = f * 16*scale + (min - 16*scale)              = q*scale + min, one FMA
            w -> bf16 -> plane tile j of an SMEM [8, BK, BC] (wgmma's B)
        acc[:, j*BC:(j+1)*BC] += x_slot @ w_j        8 wgmmas, one f32 accumulator [64, 8*BC]
    acc plane j -> SMEM -> TMA -> out f32[S, Mp, N] columns j*N8 + c*BC ..; XLA sums over S,
    drops the padded rows and casts to out_dtype

Why dequantize before the dot (as jax's mixed-type matmul does) rather than factor the scale and
min out of each group's dot (the Triton kernel): wgmma accumulates in registers across the K loop,
so per-group products need a second [64, 8*BC] accumulator, waited on and FMA'd into the first
every group (64/g FMAs a weight: 2 at g = 32), and x's rowsums; dequantizing costs one FMA a
weight, one accumulator, BK free of g. The weight is rounded to bf16 once; 16*scale is exact,
min - 16*scale off by 2^-20 * scale. The 1 + q/16 trick (the code in the mantissa of 1.0) spares
the int -> float cvt (a quarter of the FMA rate): a weight is a shift, a lop3, an FMA, half a cvt.

Why planes are separate tiles: Mosaic GPU slices a swizzled SMEM tile only at whole swizzle
widths, so plane j's [BK, BC] is its own tile with a 2*BC-byte swizzle (64 at BC = 32), and x's
tile uses the same (wgmma needs A's and B's to match). A plane's columns are contiguous in the
output and in the scales: no permutation anywhere. BC = 32 (256 outputs) where it divides N8,
else 16: TMA of a swizzled tile needs the array's minor dim to be whole tiles (N8 a multiple of
BC: no ragged column block); the accumulator (4*BC registers a thread) caps BC at 32. With g = 32
a 64-row block holds two groups; rows 32.. take the second's factors (an iota select).

Barriers: the kernel runs with `unsafe_no_auto_barriers` (Mosaic GPU's default puts two warpgroup
barriers around every SMEM store: 16 a step for the planes alone) and places two a step, each a `commit_smem` (proxy
fence + warpgroup barrier): after the factors are written, which is also where every warp is past
step t-1's `wgmma_wait` (each warp's wait covers its own share of a wgmma), so step t-1's slot is
refilled there and the plane tiles rewritten after it; and after the planes are written, before
the wgmmas. One more before the epilogue's SMEM (which reuses the loop's) is written.

Decode (M <= 64) is one row block of wgmma's M = 64 (the padding costs tensor-core cycles, not
bandwidth; only R rows of x are copied); split-K (`plan`) brings the grid to ~2 programs per SM.
A swap-AB variant (out^T = W^T @ x^T: dequantized weights as wgmma's A in registers) would shrink
the accumulator 8x at 8 rows but needs the packed tile transposed into registers; not done.

Refused with a ValueError (`check_mgpu_w4_inputs`; `int4_matmul` serves the rest): activations
other than bf16 (wgmma multiplies f32 only as tf32), shards != 1 (a column shard of an S = T
weight is an S = 1 weight), K not a multiple of 64, N not a multiple of 8 * block_c (128, or 256
at block_c 32), malformed arrays (`int4_layout.check_arrays`), configs over 227 KiB of SMEM.

`interpret=True` runs Mosaic GPU's interpreter on the CPU (SMEM, TMA, barriers, wgmma; a
warpgroup as one thread); the tests' deviceless H100 compile holds the kernel to what Mosaic GPU
lowers (Warpgroup semantics, jax's default). ptxas (sm_90a) at the Llama-3-8B decode shapes (8
rows, K x N 4096 x 14336 and 14336 x 4096, g = 128, BC = 32, BK = 64): 254 registers, no spills
(255 at g = 32, 64); BC = 16: 168; BK = 128 with BC = 32 spills 236 bytes. Untimed (no GPU).
The tiles are an `MgpuW4Config` (`mgpu_tuning`). `reference` (= `int4_matmul.int4_matmul_reference`)
is the definition the tests hold it to.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.int4_layout import PACK, check_arrays
from pallas_kernels.int4_matmul import int4_matmul_reference
from pallas_kernels.mgpu_common import ROWS, SMEM_BYTES, row_blocks, split_k, swizzled_smem
from pallas_kernels.mgpu_tuning import H100_MGPU_W4, MgpuW4Config

ONE = 0x3F800000  # f32 1.0; a code q ORed in at bit 19 makes 1 + q/16
CODE_BIT = 19
WGMMA = plgpu.Layout.WGMMA  # registers of a [64, BC] tile, as wgmma's accumulator holds them
WGMMA_COLS = WGMMA.reduce(0)  # a [BC] vector that broadcasts over a WGMMA tile's rows


@dataclasses.dataclass(frozen=True)
class _Plan:
    rows: int  # R: rows of x a program computes (a multiple of 8, <= 64)
    padded_m: int  # Mp: rows of the padded x and of the output
    block_c: int
    block_k: int
    splits: int
    num_buffers: int


def plan(m: int, k: int, n: int, config: MgpuW4Config = H100_MGPU_W4) -> _Plan:
    """Rows, tiles and split-K of x[m, k] @ W[k, n] (a heuristic, to be timed on a GPU).

    Rows: m rounded up to 8 in one row block (m <= 64), else to 64 in blocks of 64. block_c: the
    config's, or 32 where it divides n/8, else 16. block_k: the config's if it divides k, else 64.
    Splits: the config's, or the smallest divisor of the K steps that brings the grid to
    `target_programs` (at most `max_splits`; else the largest divisor under it)."""
    rows, padded_m = row_blocks(m, ROWS)
    n8 = n // PACK
    block_c = config.block_c or (32 if n8 % 32 == 0 else 16)
    block_k = config.block_k if k % config.block_k == 0 else 64
    steps = max(1, k // block_k)
    programs = padded_m // rows * -(-n8 // block_c)
    splits = split_k(steps, programs, config.splits, config.target_programs, config.max_splits)
    return _Plan(rows, padded_m, block_c, block_k, splits, config.num_buffers)


def _smem_bytes(p: _Plan, group_size: int) -> int:
    """SMEM of the loop scope or of the output scope after it, whichever is larger."""
    ng, bk, bc = max(1, p.block_k // group_size), p.block_k, p.block_c
    slot = ROWS * bk * 2 + bk * bc * 4 + 2 * ng * PACK * bc * 2  # x, codes, scales and mins
    loop = p.num_buffers * slot + 2 * ng * PACK * bc * 4 + PACK * bk * bc * 2  # factors, planes
    return max(loop, PACK * ROWS * bc * 4)


# ------------------------------------------------------------------------------------------------
# Kernel.


def _kernel(
    layer_ref,  # i32[1]            GMEM: which layer of the stack
    x_ref,  # bf16[Mp, K]           GMEM
    p_ref,  # u32[L * K, N8]        GMEM: every layer's packed codes
    s_ref,  # f16[L * G, 8, N8]     GMEM: scales by (layer and group, plane, packed column)
    z_ref,  # f16[L * G, 8, N8]     GMEM: mins
    o_ref,  # f32[S, Mp, N]         GMEM: partial sums (summed over S by XLA)
    *,
    k: int,
    g: int,
    p: _Plan,
    steps: int,
):
    i, c, s = lax.axis_index("m"), lax.axis_index("c"), lax.axis_index("s")
    rows, bc, bk, nbuf = p.rows, p.block_c, p.block_k, p.num_buffers
    n8 = p_ref.shape[1]
    ng = max(1, bk // g)  # groups whose scales a step reads
    layer = layer_ref[0]
    row0, col0 = i * rows, c * bc
    k_first = s * (steps * bk)  # this split's first row of K

    def loop_scope(x_smem, p_smem, s_smem, z_smem, f_smem, w_smem, bars):
        def issue(t):
            """TMA copies of step t's x, packed, scales and mins tiles into ring slot t % nbuf."""
            slot = lax.rem(t, nbuf)
            k0 = k_first + t * bk
            x_dst = x_smem.at[slot] if rows == ROWS else x_smem.at[slot, pl.ds(0, rows)]
            x_src = x_ref.at[pl.ds(row0, rows), pl.ds(k0, bk)]
            plgpu.copy_gmem_to_smem(x_src, x_dst, bars.at[slot])
            p_src = p_ref.at[pl.ds(layer * k + k0, bk), pl.ds(col0, bc)]
            plgpu.copy_gmem_to_smem(p_src, p_smem.at[slot], bars.at[slot])
            g0 = layer * (k // g) + k0 // g
            for ref, dst in ((s_ref, s_smem), (z_ref, z_smem)):
                src = ref.at[pl.ds(g0, ng), :, pl.ds(col0, bc)]
                plgpu.copy_gmem_to_smem(src, dst.at[slot], bars.at[slot])

        for t in range(min(nbuf, steps)):  # prologue: the ring's first tiles in flight
            issue(jnp.int32(t))

        def prepare(slot):
            """16 * scale and min - 16 * scale of the slot's groups -> f_smem (see the doc)."""
            sc16 = plgpu.load(s_smem.at[slot]).astype(jnp.float32) * 16.0  # (ng, 8, BC)
            f_smem[0] = sc16
            f_smem[1] = plgpu.load(z_smem.at[slot]).astype(jnp.float32) - sc16

        def dequantize(slot):
            """Packed slot -> the 8 bf16 plane tiles of w_smem."""

            def factor(which, gl, j):  # [64, BC] f32: 16 * scale (0) or the offset (1)
                v = plgpu.load(f_smem.at[which, gl, j], layout=WGMMA_COLS)
                return lax.broadcast_in_dim(v, (ROWS, bc), [1])

            for h in range(bk // ROWS):  # 64-row blocks: the WGMMA layout's row tile
                rows_h = pl.ds(h * ROWS, ROWS)
                q = plgpu.load(p_smem.at[slot, rows_h], layout=WGMMA)  # u32 [64, BC]
                if g < ROWS:  # g = 32: two groups a block, rows 32.. take the second
                    upper = plgpu.broadcasted_iota(jnp.int32, (ROWS, bc), 0, layout=WGMMA) >= g
                for j in range(PACK):
                    if g < ROWS:
                        sc, off = (
                            jnp.where(upper, factor(w, 2 * h + 1, j), factor(w, 2 * h, j))
                            for w in (0, 1)
                        )
                    else:
                        gl = h * ROWS // g if ng > 1 else 0
                        sc, off = factor(0, gl, j), factor(1, gl, j)
                    shift = CODE_BIT - 4 * j  # nibble j -> bits 19..22
                    v = q << shift if shift >= 0 else lax.shift_right_logical(q, jnp.uint32(-shift))
                    f = lax.bitcast_convert_type((v & (0xF << CODE_BIT)) | ONE, jnp.float32)
                    w_smem[j, rows_h] = (f * sc + off).astype(jnp.bfloat16)  # 1 + q/16 -> w

        def acc_scope(acc_ref):
            def body(t, carry):
                slot = lax.rem(t, nbuf)
                plgpu.barrier_wait(bars.at[slot])
                prepare(slot)
                # A warpgroup barrier (and proxy fence): the factors are written, and every warp
                # is past step t-1's wgmma_wait, so its x / plane tiles and slot are free.
                plgpu.commit_smem()

                @pl.when((t > 0) & (t - 1 + nbuf < steps))
                def _():
                    issue(t - 1 + nbuf)  # refill step t-1's slot

                dequantize(slot)
                plgpu.commit_smem()  # the planes visible to wgmma; the slot's codes are read
                for j in range(PACK):
                    plgpu.wgmma(acc_ref.at[:, pl.ds(j * bc, bc)], x_smem.at[slot], w_smem.at[j])
                plgpu.wgmma_wait(0)  # this warp's share of the products is done
                return carry

            lax.fori_loop(0, steps, body, None)
            return acc_ref[...]

        return pl.run_scoped(acc_scope, plgpu.ACC((ROWS, PACK * bc), jnp.float32))

    swizzle = 2 * bc  # bytes: a bf16 plane tile's row, which x's tile must match for wgmma
    acc = pl.run_scoped(
        loop_scope,
        swizzled_smem((nbuf, ROWS, bk), jnp.bfloat16, swizzle),
        swizzled_smem((nbuf, bk, bc), jnp.uint32, 4 * bc),
        plgpu.SMEM((nbuf, ng, PACK, bc), jnp.float16),  # scales
        plgpu.SMEM((nbuf, ng, PACK, bc), jnp.float16),  # mins
        plgpu.SMEM((2, ng, PACK, bc), jnp.float32),  # the step's dequantization factors
        swizzled_smem((PACK, bk, bc), jnp.bfloat16, swizzle),
        # one barrier per ring slot, arrived on by its x, packed, scales and mins copies
        plgpu.Barrier(num_arrivals=4, num_barriers=nbuf),
    )

    def store_scope(o_smem):  # o_smem reuses the loop's SMEM: every warp's wgmmas are done
        plgpu.commit_smem()
        for j in range(PACK):
            o_smem[j] = acc[:, j * bc : (j + 1) * bc]
        plgpu.commit_smem()
        for j in range(PACK):
            src = o_smem.at[j] if rows == ROWS else o_smem.at[j, pl.ds(0, rows)]
            dst = o_ref.at[s, pl.ds(row0, rows), pl.ds(j * n8 + col0, bc)]
            plgpu.copy_smem_to_gmem(src, dst)
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(store_scope, swizzled_smem((PACK, ROWS, bc), jnp.float32, 4 * bc))


@functools.partial(jax.jit, static_argnames=("group_size", "config", "interpret", "out_dtype"))
def _mgpu_call(x, packed, scales, mins, layer, group_size, config, interpret, out_dtype):
    """Jitted Mosaic GPU kernel wrapper: x [..., K] -> [..., N]."""
    *lead, k = x.shape
    x2 = x.reshape(-1, k)  # (M, K)
    m = x2.shape[0]
    n_layers, _, n8 = packed.shape
    n, groups = n8 * PACK, k // group_size
    p = plan(m, k, n, config)
    steps = k // p.block_k
    x2 = jnp.pad(x2, ((0, p.padded_m - m), (0, 0)))  # (Mp, K)
    kernel = functools.partial(_kernel, k=k, g=group_size, p=p, steps=steps // p.splits)
    grid = (p.padded_m // p.rows, n8 // p.block_c, p.splits)
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((p.splits, p.padded_m, n), jnp.float32),
        grid=grid,
        grid_names=("m", "c", "s"),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        # no barrier around every SMEM store: the kernel places its own (see the module doc)
        compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=True),
        kernel_name=(
            f"mgpu_w4_matmul_g{group_size}_r{p.rows}_bc{p.block_c}_bk{p.block_k}_s{p.splits}"
        ),
    )(
        jnp.asarray(layer, jnp.int32).reshape(1),
        x2,
        packed.reshape(n_layers * k, n8),  # bitcasts, not copies
        scales.reshape(n_layers * groups, PACK, n8),  # plane j = columns j*N8 ..
        mins.reshape(n_layers * groups, PACK, n8),
    )
    return jnp.sum(out, axis=0)[:m].astype(out_dtype).reshape(*lead, n)


def check_mgpu_w4_inputs(
    x, packed, scales, mins, group_size, layer, shards, config: MgpuW4Config
) -> None:
    """Raises ValueError naming what the Mosaic GPU kernel does not support or what is malformed."""
    if jnp.dtype(x.dtype) != jnp.bfloat16:
        raise ValueError(
            f"int4_matmul_mgpu supports bf16 activations only (wgmma bf16 x bf16 -> f32), got "
            f"{x.dtype}; f32/f16 models use int4_matmul (Triton, XLA or the reference)"
        )
    if shards != 1:
        raise ValueError(
            f"int4_matmul_mgpu reads the shards = 1 layout only, got shards={shards}; a column "
            "shard of a shards = T weight is a shards = 1 weight (run it inside shard_map)"
        )
    check_arrays(packed, scales, mins, group_size, shards)
    want_ndim = 2 if layer is None else 3
    if packed.ndim != want_ndim:
        what = "one layer's u32[K, N/8]" if layer is None else "a stack u32[L, K, N/8] with a layer"
        raise ValueError(f"int4_matmul_mgpu: packed must be {what}, got shape {packed.shape}")
    if layer is not None and jnp.ndim(layer) != 0:
        raise ValueError(f"int4_matmul_mgpu: layer must be a scalar index, got {jnp.shape(layer)}")
    k, n = packed.shape[-2], packed.shape[-1] * PACK
    if x.ndim < 1 or x.shape[-1] != k:
        raise ValueError(f"int4_matmul_mgpu: x has shape {x.shape}; its last dim must be K={k}")
    if k % ROWS:
        raise ValueError(f"int4_matmul_mgpu: K={k} must be a multiple of {ROWS} (WGMMA row tiles)")
    p = plan(math.prod(x.shape[:-1]), k, n, config)
    if n % (PACK * p.block_c):
        raise ValueError(
            f"int4_matmul_mgpu: N={n} must be a multiple of {PACK * p.block_c} (N/8 of block_c="
            f"{p.block_c}: TMA copies of swizzled SMEM tiles need whole tiles of the columns)"
        )
    need = _smem_bytes(p, group_size)
    if need > SMEM_BYTES:
        raise ValueError(
            f"int4_matmul_mgpu: {need} bytes of SMEM (block_c {p.block_c}, block_k {p.block_k}, "
            f"{p.num_buffers} buffers) exceed {SMEM_BYTES}"
        )
    if (k // p.block_k) % p.splits:
        raise ValueError(
            f"int4_matmul_mgpu: splits={p.splits} must divide the {k // p.block_k} K steps "
            f"(K={k}, block_k={p.block_k})"
        )


def int4_matmul_mgpu(
    x: jax.Array,
    packed: jax.Array,
    scales: jax.Array,
    mins: jax.Array,
    *,
    group_size: int,
    layer: jax.Array | int | None = None,
    shards: int = 1,
    out_dtype=None,
    config: MgpuW4Config | None = None,
    interpret: bool = False,
) -> jax.Array:
    """x[..., K] @ W[K, N] -> [..., N] in out_dtype (default x.dtype), f32 accumulation, W =
    (packed, scales, mins) in the INT4 layout (Mosaic GPU, Hopper).

    x:       bf16[..., K]
    packed:  u32[K, N/8];  scales, mins: f16[K/g, N]
             with `layer`: a stack u32[L, K, N/8], f16[L, K/g, N], of which layer `layer` is W
    layer:   i32[] or int (may be traced, e.g. under `lax.scan`): read in place from the stack
    shards:  must be 1 (the layout's plain packing)
    config:  an `MgpuW4Config` (default `H100_MGPU_W4`; `plan` picks the splits)
    interpret: run Mosaic GPU's interpreter (CPU tests)

    Raises ValueError for what `check_mgpu_w4_inputs` names (non-bf16 x among them).
    """
    config = config or H100_MGPU_W4
    check_mgpu_w4_inputs(x, packed, scales, mins, group_size, layer, shards, config)
    if layer is None:  # one layer: a stack of one (free reshapes)
        packed, scales, mins, layer = packed[None], scales[None], mins[None], 0
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    layer = jnp.asarray(layer, jnp.int32).reshape(())
    return _mgpu_call(x, packed, scales, mins, layer, group_size, config, interpret, out_dtype)


reference = int4_matmul_reference
"""The pure-jnp definition the kernel is held to: `int4_matmul.int4_matmul_reference`, x (as f32)
@ W (f32) for one layer's packed [K, N/8], scales and mins [K/g, N] (slice a stack's layer first)."""
