"""Timing one op on the device: `iters` calls inside one jitted `fori_loop`, so the host's dispatch
and launch of each call is not what is measured.

    device_loop(op, iters) -> jitted run(*args) -> f32[1]
    seconds_per_call(op, args, iters, repeats) -> best seconds per call over `repeats` runs

`op(*args)` runs `iters` times in one program. Two optimization barriers keep every call real:
- the inputs pass through a barrier together with the loop's carry, so each iteration's inputs
  depend on the previous one: XLA cannot hoist the op, or a loop-invariant part of it (an INT4
  weight's dequantize, a gather of pages), out of the loop;
- the output passes through a barrier before one element of it feeds the carry, so XLA cannot
  narrow the op to that element (push a slice through a dot or a split-K reduction).
The carry is one f32, so the loop adds only a one-thread add per iteration. A known trip count:
XLA's while loop runs it without a host round trip per iteration.

`experiments/gpu_kernels.py` and `gpu_quant_matmul.py` time their candidates with it;
`tests/bench/test_device_loop.py` compiles it for an H100 (deviceless) and checks what the loop body
holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp


def device_loop(op: Callable, iters: int, **jit_kwargs):
    """A jitted run(*args) calling op(*args) `iters` times on the device (see the module doc);
    jit_kwargs go to jax.jit (e.g. compiler_options)."""

    def run(*args):
        def body(_, carry):  # carry: f32[1]
            args_i, _ = jax.lax.optimization_barrier((args, carry))
            out = jax.lax.optimization_barrier(op(*args_i))
            first = jax.tree.leaves(out)[0].reshape(-1)[:1]
            return carry + first.astype(jnp.float32)

        return jax.lax.fori_loop(0, iters, body, jnp.zeros((1,), jnp.float32))

    return jax.jit(run, **jit_kwargs)


def seconds_per_call(
    op: Callable, args: tuple, iters: int, repeats: int = 3, **jit_kwargs
) -> float:
    """Best seconds per call of op(*args) over `repeats` runs of device_loop(op, iters), after one
    run that compiles and warms up."""
    run = device_loop(op, iters, **jit_kwargs)
    jax.block_until_ready(run(*args))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(run(*args))
        best = min(best, (time.perf_counter() - t0) / iters)
    return best
