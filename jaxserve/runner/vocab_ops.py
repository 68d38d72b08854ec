"""Reductions over the vocabulary that the sampler needs, without sorting it: the greedy argmax
in two levels, and the top-k / top-p cuts as threshold values found by bisection on the logits'
ordered bits. Pure functions of [S, V] arrays (no sampler state); `sampling.sample` calls them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def blocked_argmax(x: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis of x [S, V] -> i32[S], in two levels: the first block of b
    columns holding the row's max, then the first max within it. The same index as jnp.argmax
    (first of ties; a NaN counts as the max). XLA's CPU argmax over the vocabulary is one
    sequential variadic reduce, a few ms at [32, 49152]; two plain reductions and a small
    argmax are a fraction of that (the greedy sampler: 0.8x, JOURNAL.md section 36). b is
    the largest divisor of V in [64, 512]; without one, plain jnp.argmax."""
    s, v = x.shape
    b = next((b for b in range(512, 63, -1) if v % b == 0), None)
    if b is None:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    blocks = x.reshape(s, v // b, b)
    j = jnp.argmax(jnp.max(blocks, axis=-1), axis=-1)  # (S,) the first block with the max
    block = jnp.take_along_axis(blocks, j[:, None, None], axis=1)[:, 0]  # (S, b)
    idx = (j * b + jnp.argmax(block, axis=-1)).astype(jnp.int32)
    # XLA's CPU max does not carry a NaN through, so a NaN row takes the plain argmax
    return jax.lax.cond(
        jnp.any(jnp.isnan(x)), lambda: jnp.argmax(x, axis=-1).astype(jnp.int32), lambda: idx
    )


def _ordered_key(x: jax.Array) -> jax.Array:
    """f32 -> u32 whose unsigned order is the float order (the radix-sort key)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _largest_key_rows(holds, num_rows: int) -> jax.Array:
    """Per row, the largest u32 t with holds(t) true, for holds monotone (true at 0, then false).

    holds: u32[S] -> bool[S]. Bisection over the bits, most significant first: 32 passes.
    """

    def set_bit(i, t):  # (S,) -> (S,)
        candidate = t | jnp.left_shift(jnp.uint32(1), (31 - i).astype(jnp.uint32))
        return jnp.where(holds(candidate), candidate, t)

    return jax.lax.fori_loop(0, 32, set_bit, jnp.zeros((num_rows,), jnp.uint32))


def apply_top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Masks (-inf) all but the k best, then all but the tokens vLLM's top-p keeps.

    logits f32[S, V] (already temperature-scaled); top_k i32[S] (0 = off); top_p f32[S] (1 = off).
    vLLM's rules (`v1/sample/ops/topk_topp_sampler.py`, the same as HF's warpers): top-k keeps
    every token at or above the k-th largest logit (ties with it too); top-p then works on the
    top-k-renormalized distribution sorted ascending (a stable sort: among equal logits the lower
    id comes first) and drops each token whose cumulative probability is <= 1 - p, so a token is
    kept iff the tokens after it hold less than p, and of a run of tied logits at the cut only as
    many are kept as the mass needs (the higher ids). The cuts are threshold values found by
    bisection on the ordered bits (no sort: 2 x 32 passes over [S, V], about 10x faster than
    jnp.sort on CPU), then the tied run at the top-p cut is split by a cumulative count.
    """
    s, v = logits.shape
    keys = _ordered_key(logits)  # (S, V)
    k = jnp.where((top_k <= 0) | (top_k > v), v, top_k)  # (S,)

    def enough_tokens(t):  # (S,) -> (S,): at least k tokens at or above t
        return jnp.sum(keys >= t[:, None], axis=-1) >= k

    k_cut = _largest_key_rows(enough_tokens, s)  # (S,) = the k-th largest key
    probs = jax.nn.softmax(jnp.where(keys >= k_cut[:, None], logits, -jnp.inf), axis=-1)

    def enough_mass(t):  # (S,) -> (S,): the tokens at or above t hold at least top_p
        return jnp.sum(jnp.where(keys >= t[:, None], probs, 0.0), axis=-1) >= top_p

    p_cut = jnp.where(top_p < 1.0, _largest_key_rows(enough_mass, s), 0)  # (S,); 0 keeps all
    # The run tied at p_cut, in id order: tied token j is followed (ascending, stable) by the
    # n - 1 - j tied ones of higher id and by every larger token; kept iff those hold < p.
    tied = keys == p_cut[:, None]  # (S, V)
    n_tied = jnp.sum(tied, axis=-1, keepdims=True)  # (S, 1)
    after_in_run = n_tied - jnp.cumsum(tied, axis=-1)  # (S, V): tied tokens of higher id
    mass_above = jnp.sum(jnp.where(keys > p_cut[:, None], probs, 0.0), axis=-1, keepdims=True)
    tied_kept = tied & (mass_above + after_in_run * probs < top_p[:, None])
    # p_cut >= k_cut (the top-k set holds all the mass), so the top-p set lies inside the top-k set
    top_p_set = (keys > p_cut[:, None]) | tied_kept
    keep = jnp.where(top_p[:, None] < 1.0, top_p_set, keys >= k_cut[:, None])
    return jnp.where(keep, logits, -jnp.inf)


TOP_K_BLOCK = 1024  # vocabulary entries per block of `top_k`'s first pass


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """jax.lax.top_k over the last axis of x [N, V] -> (values [N, k], i32 ids [N, k]), equal to
    it (ties: the lower id first), in two passes that never sort the whole vocabulary: the k best
    of each block of TOP_K_BLOCK entries, then the k best of those N x (V / b) x k candidates.

    Why: XLA:GPU lowers a top-k over a 128k vocabulary to a full sort of each row: a bitonic sort
    of some 20 kernel launches, or CUB's radix sort, whose scratch size XLA asks the device for
    while compiling (so the program cannot be compiled without a GPU: the sampler at 1 and 64
    slots failed deviceless, `cudaErrorInvalidDevice`). Blocks of 1,024 and a second pass over
    ~2,500 candidates are sorts XLA does in a few launches of its own kernel. Exact: each of the
    k best is among the k best of its block, and the candidates keep block order (ids increase
    with position), so ties resolve as in one pass."""
    n, v = x.shape
    b = TOP_K_BLOCK
    if k == 0 or v <= 2 * b or k > b:
        values, ids = jax.lax.top_k(x, k)
        return values, ids.astype(jnp.int32)
    pad = -v % b
    if pad:  # padding never outranks a real entry (-inf ties with one: the lower id wins)
        fill = jnp.array(
            -jnp.inf if jnp.issubdtype(x.dtype, jnp.floating) else jnp.iinfo(x.dtype).min, x.dtype
        )
        x = jnp.concatenate([x, jnp.broadcast_to(fill, (n, pad))], axis=1)
    blocks = x.reshape(n, -1, b)  # (N, V / b, b)
    values, ids = jax.lax.top_k(blocks, k)  # (N, V / b, k)
    ids = ids + (jnp.arange(blocks.shape[1], dtype=ids.dtype) * b)[None, :, None]
    values, pick = jax.lax.top_k(values.reshape(n, -1), k)  # (N, k)
    return values, jnp.take_along_axis(ids.reshape(n, -1), pick, axis=1).astype(jnp.int32)
