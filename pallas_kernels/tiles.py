"""Tiled (grouped) calls of the stacked-weight matmul kernels: each row tile reads its own layer.

A mixture-of-experts layer multiplies each token by the weights of the experts it chose. Sorted by
expert and padded so that every tile of `tile_rows` rows holds one expert's rows (`layers/moe.py`),
its rows meet their expert in one launch of the INT4 or W8A16 kernel, handed the whole stack of
experts [L, K, N] (L = layers x experts) and one index per tile instead of one per call:

    x        [T * b, K]          T tiles of b = tile_rows rows
    tiles    i32[T]              tile t's rows times layer tiles[t] of the stack; tiles[t] < 0:
                                 the tile is padding, its rows come out 0 and read no weight
    out      [T * b, N]          out[t*b:(t+1)*b] = x[t*b:(t+1)*b] @ W[tiles[t]]

The kernels run tile t as their row block t (block_m = b), so each used tile reads its expert's
weight once, in place, and an unused tile costs one predicate (vLLM's fused MoE kernel does the
same with its per-block expert ids). `per_tile` is the XLA / reference form of the same call (a
`vmap` over tiles, each slicing its layer out).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def check_layer(x, layer, tile_rows, kernel: bool) -> None:
    """A stacked-weight kernel's `layer` / `tile_rows` arguments: a scalar layer, or (a tiled
    call) x [T * tile_rows, K] with layer i32[T] (`check_tiles`); ValueError naming the problem."""
    if tile_rows is None and layer is not None and jnp.ndim(layer) != 0:
        raise ValueError(
            f"layer must be a scalar index (or i32[T] with tile_rows=, a tiled call), got shape "
            f"{jnp.shape(layer)}"
        )
    if tile_rows is not None:
        if layer is None or x.ndim != 2:
            raise ValueError("a tiled call (tile_rows=) needs x [M, K] and layer= i32[T]")
        check_tiles(x.shape[0], layer, tile_rows, kernel)


def check_tiles(rows: int, tiles, tile_rows, kernel: bool) -> None:
    """ValueError unless `tiles` i32[T] with tiles of `tile_rows` rows covers exactly `rows`
    rows (and, for a kernel, tile_rows is a power of two >= 16: the kernel's row block)."""
    if jnp.ndim(tiles) != 1 or not jnp.issubdtype(jnp.result_type(tiles), jnp.integer):
        raise ValueError(f"tiles must be int[T], got {jnp.result_type(tiles)}{jnp.shape(tiles)}")
    if not isinstance(tile_rows, int) or tile_rows < 1:
        raise ValueError(f"tile_rows must be a positive int with tiles=, got {tile_rows!r}")
    if kernel and (tile_rows < 16 or tile_rows & (tile_rows - 1)):
        raise ValueError(f"a kernel's tile_rows must be a power of two >= 16, got {tile_rows}")
    if rows != jnp.shape(tiles)[0] * tile_rows:
        raise ValueError(
            f"x has {rows} rows; {jnp.shape(tiles)[0]} tiles of {tile_rows} rows need "
            f"{jnp.shape(tiles)[0] * tile_rows}"
        )


def per_tile(matmul_one: Callable, x2: jax.Array, tiles: jax.Array, tile_rows: int) -> jax.Array:
    """x2 [T * b, K] -> [T * b, N]: each tile's rows through matmul_one(rows [b, K], layer i32[])
    (a layer of the stack, sliced out), 0 for a negative tile."""
    t = tiles.shape[0]
    xt = x2.reshape(t, tile_rows, x2.shape[-1])  # (T, b, K)
    y = jax.vmap(lambda xi, li: matmul_one(xi, jnp.maximum(li, 0)))(xt, tiles)  # (T, b, N)
    y = jnp.where((tiles >= 0)[:, None, None], y, jnp.zeros((), y.dtype))
    return y.reshape(t * tile_rows, y.shape[-1])


__all__ = ["check_layer", "check_tiles", "per_tile"]
