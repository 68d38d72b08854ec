"""A bf16 matmul on XLA's CPU backend that reads one layer of a stacked weight in place: a C++
kernel called through XLA's FFI.

    matmul(x, w, layer=0, out_dtype=None) -> x[..., K] @ w[layer].T  ([..., N])
    matmul_many(x, (w1, w2, ...), layer=0) -> (x @ w1[layer].T, x @ w2[layer].T, ...)

w is a stack [L, N, K] of weights stored [out, in] (PyTorch's nn.Linear layout; a 2-D [N, K]
weight is one layer), x and w bf16; the result is bf16 (default) or f32, accumulated in f32.
Why a kernel:
inside `lax.scan`, XLA's CPU backend copies every layer's weights out of the stack before its
GEMM, and on decode-sized batches that GEMM reaches about half of what AVX512-BF16's dot product
instruction does here. The kernel (`matmul.cc` beside this file) reads the layer where it lies,
prefetching into L2, on XLA's intra-op thread pool (JOURNAL.md sections 38, 40, 41 and 49c-d).
Each output is summed in one fixed order whatever the number of rows, so a row's result never
depends on the batch.

`matmul_reference` at the end of this file is the pure-jnp definition; tests compare the two
(tests/cpu_kernels/). The kernel is compiled on first use (`build.py`); `available()` says whether
that worked (`build_error()` why not) and `path()` which loop this CPU's build runs: VDPBF16PS
with AVX512-BF16, FMAs on bit-widened bf16 with AVX2, or a portable loop (jaxserve's 'auto'
uses the first two, `jaxserve.resolve`). The AVX2 and portable loops give the same bits; the
AVX512-BF16 loop sums in their order as VDPBF16PS is defined (tested to f32 rounding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cpu_kernels.build import BuildError, FfiTarget

TARGET = "jaxserve_matmul"
KERNEL = FfiTarget("matmul.cc", TARGET, "JaxserveMatmul")
MANY_TARGET = "jaxserve_matmul_many"
MANY_KERNEL = FfiTarget("matmul.cc", MANY_TARGET, "JaxserveMatmulMany")


def available() -> bool:
    """Whether the kernel is compiled and registered for the CPU backend (builds it if needed)."""
    return build_error() is None


def build_error() -> str | None:
    """Why the kernel is not available, or None when it is."""
    return KERNEL.error() or MANY_KERNEL.error()


PATHS = ("portable", "avx2", "avx512bf16")


def path() -> str | None:
    """The loop this CPU's build runs: 'avx512bf16' (VDPBF16PS), 'avx2' (AVX2 + FMA, bf16 widened
    by bit operations) or 'portable' (plain C++); None when the kernel does not build here. All
    three compute the same sums in the same order."""
    if not available():
        return None
    return PATHS[KERNEL.library.load().JaxserveMatmulPath()]


def matmul(x: jax.Array, w: jax.Array, layer: jax.Array | int = 0, out_dtype=None) -> jax.Array:
    """x bf16[..., K], w bf16[L, N, K] (or [N, K]), layer i32[] | int -> [..., N] in out_dtype
    (bf16 or f32; default bf16). CPU only (an FFI target registered for the CPU platform)."""
    (y,) = _call(TARGET, x, [w], layer, out_dtype)
    return y


def matmul_many(
    x: jax.Array, ws, layer: jax.Array | int = 0, out_dtype=None
) -> tuple[jax.Array, ...]:
    """`matmul(x, w, layer, out_dtype)` for each w of `ws` (stacks sharing K and L), in one
    kernel call: one space of work tiles over all the weights, so the threads are woken once per
    call and a small weight (k, v) is shared between them too. Each result has the bits `matmul`
    gives it alone."""
    return _call(MANY_TARGET, x, list(ws), layer, out_dtype)


def _call(target, x, ws, layer, out_dtype) -> tuple[jax.Array, ...]:
    err = build_error()
    if err is not None:
        raise BuildError(f"the CPU matmul kernel is not available: {err}")
    ws = [w[None] if w.ndim == 2 else w for w in ws]
    for w in ws:
        if w.ndim != 3 or x.shape[-1] != w.shape[-1] or w.shape[0] != ws[0].shape[0]:
            raise ValueError(f"matmul: x {x.shape} does not fit w {w.shape} ([L, N, K])")
        if x.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16:
            raise ValueError(f"matmul: x and w must be bfloat16, got {x.dtype} and {w.dtype}")
    out_dtype = jnp.dtype(out_dtype or jnp.bfloat16)
    if out_dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise ValueError(f"matmul: out_dtype must be bfloat16 or float32, got {out_dtype}")
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    shapes = [jax.ShapeDtypeStruct((x2.shape[0], w.shape[1]), out_dtype) for w in ws]
    layer = jnp.asarray(layer, jnp.int32)
    if target == TARGET:
        ys = [jax.ffi.ffi_call(target, shapes[0])(x2, ws[0], layer)]
    else:
        ys = jax.ffi.ffi_call(target, shapes)(x2, layer, *ws)
    return tuple(y.reshape(*lead, y.shape[-1]) for y in ys)


def matmul_reference(
    x: jax.Array, w: jax.Array, layer: jax.Array | int = 0, out_dtype=None
) -> jax.Array:
    """The definition: sum_k x[..., k] * w[layer, n, k] in f32 (inputs widened exactly), then
    rounded once to out_dtype (default bf16)."""
    if w.ndim == 2:
        w = w[None]
    wl = jax.lax.dynamic_index_in_dim(w, jnp.asarray(layer, jnp.int32), keepdims=False)
    y = jnp.einsum(
        "...k,nk->...n",
        x.astype(jnp.float32),
        wl.astype(jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
    )
    return y.astype(out_dtype or jnp.bfloat16)
