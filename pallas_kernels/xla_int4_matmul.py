"""XLA-native INT4 weights: `x @ (w.astype(bf16) * scale)` with a `jnp.int4` weight, no Pallas.

The candidate the INT4 kernels (`int4_matmul.py`, `mgpu_w4_matmul.py`) must beat on the GPU
(issue 55): XLA itself generating the dequantize-and-multiply. Layout, one layer:

    w       s4[K, N]          signed codes -8..7 (jnp.int4: two per byte in memory, K*N/2 bytes)
    scales  bf16[K/g, N]      one scale per g consecutive rows of a column (symmetric: no min)
    W[k, n] = w[k, n] * scales[k // g, n]

`xla_int4_matmul` is written in the shape XLA's subchannel-dequantisation fusion matches (its
flag's help text: "[x,z]param -> [x,y,z]broadcast -> [x*y,z]bitcast -> multiply -> dot"): the
scales broadcast over each group and reshaped to [K, N], multiplied into the converted weight,
then the dot. What XLA 0.11.2 builds for an H100 (deviceless compile, decode M = 1..64 and
prefill M = 512, K = 4096, N = 14336; `tests/pallas_kernels/test_xla_int4_matmul.py`):

- XLA's defaults: a transpose fusion writes the whole dequantized weight as bf16[N, K] (4x the
  int4 bytes), then a Triton GEMM reads it back: each call moves ~9x the int4 weight's bytes.
- with `SUBCHANNEL_FLAG` = True: one Triton GEMM fusion reads the s4 weight and the scales
  directly (the dequantize inside the GEMM's operand load); nothing is materialized.

The symmetric RTN grid of `jaxserve.quant.rtn` (codes 0..15, min = -8 * scale) is this one with
codes - 8, so `from_rtn` turns the engine's RTN codes into these arrays (scales rounded to bf16).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# The XLA GPU option that lets the dequantize fuse into the GEMM (present in jaxlib 0.11.2; off by
# default there). Pass it in `compiler_options` of the jit that holds the matmul.
SUBCHANNEL_FLAG = "xla_gpu_experimental_enable_subchannel_dequantisation_fusion"


def from_rtn(codes: jax.Array, scales: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric RTN codes u8[..., K, N] (0..15, zero at 8) and scales f32[..., K/g, N] ->
    (w s4[..., K, N], scales bf16[..., K/g, N])."""
    return (codes.astype(jnp.int8) - 8).astype(jnp.int4), scales.astype(jnp.bfloat16)


def _check(x: jax.Array, w: jax.Array, scales: jax.Array) -> int:
    """-> the group size g; raises ValueError on shapes or dtypes this layout does not have."""
    if w.dtype != jnp.int4 or w.ndim != 2:
        raise ValueError(f"w must be int4[K, N], got {w.dtype}{list(w.shape)}")
    k, n = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x's last dim {x.shape[-1]} != K = {k}")
    if scales.ndim != 2 or scales.shape[1] != n or k % scales.shape[0]:
        raise ValueError(f"scales must be [K/g, N] = [K/g, {n}], got {list(scales.shape)}")
    return k // scales.shape[0]


def xla_int4_matmul(x: jax.Array, w: jax.Array, scales: jax.Array) -> jax.Array:
    """x bf16[M, K] @ dequantized w -> bf16[M, N] (f32 accumulation in XLA's GEMM)."""
    g = _check(x, w, scales)
    k, n = w.shape
    # [K/g, N] -> [K/g, g, N] -> [K, N]: the broadcast-then-bitcast XLA's fusion looks for
    s = jnp.broadcast_to(scales[:, None, :], (k // g, g, n)).reshape(k, n)  # (K, N)
    return jnp.dot(x, w.astype(x.dtype) * s.astype(x.dtype), preferred_element_type=x.dtype)


def xla_int4_matmul_reference(x: jax.Array, w: jax.Array, scales: jax.Array) -> jax.Array:
    """f32[M, N]: the weight dequantized in f32 and the dot at full f32 precision."""
    g = _check(x, w, scales)
    wf = w.astype(jnp.float32) * jnp.repeat(scales.astype(jnp.float32), g, axis=0)  # (K, N)
    return jnp.dot(x.astype(jnp.float32), wf, precision=jax.lax.Precision.HIGHEST)
