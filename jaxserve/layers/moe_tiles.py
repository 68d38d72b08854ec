"""A mixture of experts' pairs in row tiles of one expert each (`moe.moe_mlp`'s 'tiled' and 'kernel'
paths), and a layer's experts left in the model's stack.

    StackedExperts(stack [Ls, E, K, N], index)       a layer's experts where the model keeps them
    tile_rows(P, E) -> b                             the 'tiled' path's rows per tile
    kernel_tile(ws, P, E) -> b | None                the 'kernel' path's, or None where it should
                                                     not run (`moe_mlp` then takes 'ragged_dot')
    tiled_swiglu(xs, group_sizes, w_gate, w_up, w_down) -> [P, D]         a loop over the tiles
    kernel_swiglu(xs, group_sizes, w_gate, w_up, w_down, b) -> [P, D]     one launch a weight

xs [P, D] are the (token, expert) pairs sorted by expert, group_sizes i32[E] the pairs per expert
(`moe._dispatch`); rows past sum(group_sizes) come out as exact zeros.

The 'tiled' path (`jaxserve.resolve` picks it on CPU) does only the chosen experts' work. Each
expert's sorted pairs are padded up to whole tiles of `b` rows (`tile_rows`), so a tile holds one
expert's rows; a `fori_loop` over the step's used tiles (a traced trip count, no recompilation)
multiplies each tile by its own expert's matrices:

    tiles_e  = ceil(group_sizes[e] / b)       used tiles = sum_e tiles_e <= P // b + min(E, P)
    xs_pad   [max_tiles * b, D]               pair j of expert e at row tile_start[e] * b + rank
    for t < used tiles: y_pad[t*b:(t+1)*b] = swiglu(xs_pad[t*b:(t+1)*b], experts of tile t)

Weights read per step: the chosen experts' (each once per tile; one tile per expert at decode
sizes), FLOPs: (P + padding) * 3 * D * I with padding < b per used expert. Measured against
`ragged_dot` at Qwen3-30B-A3B's and Mixtral's layer shapes by a benchmark since retired
(JOURNAL.md section 33). Quantized experts multiply through the weight's `matmul(x, layer=e)`:
only the chosen experts are read, quantized (INT8 / FP8's per-channel scales apply to the dot's
outputs).

The 'kernel' path (GPU, the engine's choice for quantized weights with a kernel impl) lays the
pairs out in the same tiles (b rows: `kernel_tile`) and hands all of them to one launch per weight
(`pallas_kernels/tiles.py`): w_gate, w_up and w_down each run the INT4 / W8A16 kernel over the
whole stack with one expert index per tile, so each used tile reads its expert's quantized
weight in place and the unused tiles (the static count `P // b + min(E, P)` covers any routing)
read nothing. b is `tile_rows`, at least 16 (the kernels' smallest row block) and at most what
every weight's kernel takes in place (`Int4Weight.tiles_in_place(b)`: a kernel impl, b within
its `kernel_rows`, the plain packing / per-channel scales). Where no b is, or where the tiles
could pass MAX_TILES_PER_EXPERT (a long prefill chunk, whose experts would be read more times
than the dequantize moves bytes), it takes 'ragged_dot'.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class StackedExperts(NamedTuple):
    """One layer's experts where the model keeps them: `stack` [Ls, E, K, N] (a plain array or a
    quantized-weight pytree) and `index`, the layer's row of it (i32[], traced in the scan)."""

    stack: object
    index: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.stack.shape[1:])  # (E, K, N)

    def layer(self):
        """The layer's [E, K, N] (sliced out of the stack: a copy)."""
        return jax.tree.map(
            lambda a: jax.lax.dynamic_index_in_dim(a, self.index, keepdims=False), self.stack
        )

    def flat(self) -> tuple[object, jax.Array]:
        """(the stack as [Ls * E, K, N], a free reshape; the row of the layer's expert 0)."""
        e = self.stack.shape[1]
        flat = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), self.stack)
        return flat, self.index * e


def _flat(w) -> tuple[object, jax.Array | int]:
    """(a stack whose rows are experts, the row of this layer's expert 0)."""
    return w.flat() if isinstance(w, StackedExperts) else (w, 0)


def tile_rows(num_pairs: int, num_experts: int) -> int:
    """The 'tiled' path's rows per tile b (static): 8 while experts average under 16 pairs
    (decode: one tile per chosen expert, and no bf16 dot of under 4 rows, which XLA's CPU runs by
    converting the whole weight to f32, JOURNAL.md section 17), else the power of two <= P / E,
    at most 128 (prefill chunks: the padding, < b rows per expert, stays under the P real rows)."""
    per = num_pairs // num_experts
    if per < 16:
        return 8
    return min(128, 1 << (per.bit_length() - 1))


# The 'kernel' path's limit on tiles, per expert: each used tile reads its expert's weight once,
# so up to this many tiles an expert (P // b + min(E, P) in all, any routing) the step reads less
# than `ragged_dot`'s dequantize moves for every expert (its quantized read, then the bf16 copy
# written and read: 5x an FP8 / INT8 expert's bytes, 9x an INT4 one's).
MAX_TILES_PER_EXPERT = 4


def kernel_tile(ws, num_pairs: int, num_experts: int) -> int | None:
    """The 'kernel' path's rows per tile for weights ws (w_gate, w_up, w_down): `tile_rows`, at
    least 16 (the kernels' smallest row block) and at most what every weight's kernel takes in
    place (`tiles_in_place`; INT4's 16, W8A16's 64 by the shipped GPU kernel table); None where
    none is, or where the worst case's tiles pass MAX_TILES_PER_EXPERT (a long prefill chunk:
    `ragged_dot` then reads less)."""

    def takes(b):
        return all(getattr(_flat(w)[0], "tiles_in_place", lambda b: False)(b) for w in ws)

    b = max(16, tile_rows(num_pairs, num_experts))
    while b > 16 and not takes(b):
        b //= 2
    tiles = num_pairs // b + min(num_experts, num_pairs)
    return b if takes(b) and tiles <= MAX_TILES_PER_EXPERT * num_experts else None


def _expert_matmul(a: jax.Array, w, e) -> jax.Array:
    """a [b, K] @ expert e of the stack w [E, K, N] or `StackedExperts` (plain, or quantized:
    only that expert is read and dequantized) -> [b, N] in a.dtype."""
    flat, first = _flat(w)
    if hasattr(flat, "matmul"):
        return flat.matmul(a, layer=first + e).astype(a.dtype)
    return a @ jax.lax.dynamic_index_in_dim(flat, first + e, keepdims=False).astype(a.dtype)


def _tile_layout(xs, group_sizes, b: int):
    """The pairs xs [P, D] in tiles of b rows, each tile one expert's (see the module docstring)
    -> (xs_pad [max_tiles * b + 1, D]; pos i32[P]: each sorted pair's row in it, the spare zero
    row max_tiles * b for rows past the groups; tile_expert i32[max_tiles]; used tiles i32[];
    max_tiles)."""
    p, d = xs.shape
    g = group_sizes.shape[0]
    max_tiles = p // b + min(g, p)
    tiles = (group_sizes + b - 1) // b  # (G,)
    tile_end = jnp.cumsum(tiles)  # (G,)
    tile_start = tile_end - tiles
    group_start = jnp.cumsum(group_sizes) - group_sizes
    row = jnp.arange(p, dtype=jnp.int32)
    used = row < jnp.sum(group_sizes)
    expert_of = jnp.minimum(
        jnp.searchsorted(jnp.cumsum(group_sizes), row, side="right", method="compare_all"), g - 1
    )
    # each pair's row in the padded buffer; rows past the groups go to a spare zero row
    pos = jnp.where(used, tile_start[expert_of] * b + row - group_start[expert_of], max_tiles * b)
    tile_expert = jnp.minimum(
        jnp.searchsorted(
            tile_end, jnp.arange(max_tiles, dtype=jnp.int32), side="right", method="compare_all"
        ),
        g - 1,
    )
    xs_pad = jnp.zeros((max_tiles * b + 1, d), xs.dtype).at[pos].set(xs, unique_indices=True)
    return xs_pad, pos, tile_expert, tile_end[-1], max_tiles


def tiled_swiglu(xs, group_sizes, w_gate, w_up, w_down):
    """xs [P, D] sorted by expert, group_sizes i32[G] (sum <= P) -> [P, D]: row j times its
    expert's SwiGLU; rows past sum(group_sizes) are exact zeros (see the module docstring)."""
    p, d = xs.shape
    b = tile_rows(p, group_sizes.shape[0])
    xs_pad, pos, tile_expert, used_tiles, max_tiles = _tile_layout(xs, group_sizes, b)
    pad_rows = max_tiles * b

    def tile(t, y_pad):  # rows [t*b, (t+1)*b) are all expert tile_expert[t]'s
        e = tile_expert[t]
        rows = jax.lax.dynamic_slice_in_dim(xs_pad, t * b, b)  # (b, D)
        gate, up = _expert_matmul(rows, w_gate, e), _expert_matmul(rows, w_up, e)  # (b, I)
        h = jax.nn.silu(gate.astype(jnp.float32)).astype(xs.dtype) * up
        return jax.lax.dynamic_update_slice_in_dim(y_pad, _expert_matmul(h, w_down, e), t * b, 0)

    y_pad = jax.lax.fori_loop(0, used_tiles, tile, jnp.zeros((pad_rows + 1, d), xs.dtype))
    return y_pad[pos]  # (P, D)


def kernel_swiglu(xs, group_sizes, w_gate, w_up, w_down, b: int):
    """`tiled_swiglu` with every tile of b rows in one kernel launch per weight (the 'kernel'
    path): tile t multiplies by its expert's row of the stack, an unused tile (-1) is skipped."""
    d = xs.shape[1]
    xs_pad, pos, tile_expert, used_tiles, max_tiles = _tile_layout(xs, group_sizes, b)
    pad_rows = max_tiles * b
    used = jnp.arange(max_tiles, dtype=jnp.int32) < used_tiles

    def matmul(a, w):  # a [pad_rows, K] -> [pad_rows, N]: one launch over every tile
        flat, first = _flat(w)
        tiles = jnp.where(used, first + tile_expert, -1)  # (max_tiles,)
        return flat.matmul(a, layer=tiles, tile_rows=b).astype(a.dtype)

    rows = xs_pad[:pad_rows]
    gate, up = matmul(rows, w_gate), matmul(rows, w_up)  # (pad_rows, I)
    h = jax.nn.silu(gate.astype(jnp.float32)).astype(xs.dtype) * up
    y = jnp.concatenate([matmul(h, w_down), jnp.zeros((1, d), xs.dtype)])  # + the spare row
    return y[pos]  # (P, D)
