"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router and dropless top-k dispatch.

    route(router_logits f32[N, E], k, norm_topk_prob) -> (weights f32[N, k], experts i32[N, k])
    moe_mlp(x [N, D], router_logits [N, E], w_gate, w_up [E, D, I], w_down [E, I, D], k,
            norm_topk_prob, grouped="ragged_dot") -> [N, D] in x.dtype     the dropless path
        grouped: how the sorted pairs meet their experts: 'ragged_dot' (`jax.lax.ragged_dot`,
        GPU, float experts), 'kernel' (GPU, quantized experts: one launch of the INT4 / W8A16
        kernel per weight over row tiles of one expert each) or 'tiled' (a loop over the same
        tiles, CPU); the same result
    moe_mlp_reference(...same...) -> [N, D]                 every expert densely on every token
    expert_stack(w, dtype) -> [E, K, N] in dtype            a plain or quantized expert stack
    StackedExperts(stack [Ls, E, K, N], index)              a layer's experts left in the model's
                                                            stack (quantized: read in place)

Routing, as Hugging Face computes it (transformers 5.24 `MixtralTopKRouter`, `Qwen3MoeTopKRouter`):
the router logits x @ W_r are taken in the activation dtype, then a softmax in f32 over all E,
then the top k by probability (descending), then for Mixtral always, for Qwen3-MoE when
`norm_topk_prob`, the k probabilities are divided by their sum. Mixtral's "softmax over the chosen
logits" is exactly that renormalized top-k, so the two families differ by `norm_topk_prob` alone.

Dataflow of `moe_mlp` (N tokens, P = N * k (token, expert) pairs; every shape is fixed by N and
k, and the routing enters only as traced arrays, so no routing can recompile it):

    1. route                                      weights f32[N, k], experts i32[N, k]
    2. order = stable argsort of the P flat expert ids: pairs sorted by expert   i32[P]
       group_sizes = the pairs per expert (bincount, length E)                   i32[E]
    3. xs = x[order // k]                         the pairs' token rows, by expert  [P, D]
    4. h = silu(xs @G w_gate) * (xs @G w_up)      [P, I]    @G: `jax.lax.ragged_dot`, rows of
       y = h @G w_down                            [P, D]    group e times expert e's matrix
    5. unsort y to pair order                     [N, k, D], then out = sum_j weights[:, j] y[:, j]

Dropless: every pair is computed (no capacity factor), so a padding row can never push a real
token out of its expert.

Cost of `ragged_dot` by backend (jax 0.11.2): for CUDA it lowers to `chlo.ragged_dot`, left to
XLA's GPU compiler (tests/test_cuda_lowering.py checks the lowering; its GPU speed is unmeasured
here). On CPU jax's generic lowering masks lhs per group and contracts over [E * K]: E times the
active FLOPs, and every expert's weights are read whatever the routing.

Expert parallelism (tensor_parallel_size T > 1 dividing E): the expert stacks are split over E on
the mesh's 'model' axis, so each device holds E/T experts (`parallel/partition.py`, role
'expert'); the router, attention and dense layers keep their usual tensor-parallel rules. Inside
`jax.shard_map`, every device routes all N tokens (replicated), runs its grouped matmul on the sorted
pairs of its own experts only, and a psum of the [N, D] partial outputs adds the devices' shares:
one all-reduce per MoE layer, the same as a row-parallel dense MLP, and no all-to-all (tokens are
replicated under TP anyway). T not dividing E keeps the experts replicated (logged).

Quantized experts (INT8 / FP8 / INT4 stacks) are taken as stored: one layer's [E, K, N], or,
inside the model's layer scan, `StackedExperts` (the whole [Ls, E, K, N] stack and the layer's
index, so that no layer's experts are copied out of the stack).

The 'tiled' path (CPU) and the 'kernel' path (GPU, quantized experts: one launch of the INT4 /
W8A16 kernel per weight) lay the sorted pairs out in row tiles of one expert each and read only
the chosen experts; they are `moe_tiles.py`.

On 'ragged_dot' and under expert parallelism, `expert_stack` dequantizes one layer's [E, K, N]
stack to the activation dtype inside the step and `ragged_dot` multiplies that: exact to the
stored weights, and simple. Its cost: per layer and step, the stack is read quantized (~1 byte
per weight for INT8/FP8, ~0.56 for INT4-g64 with its f16 scales and mins), then a bf16 copy is
written and read again (4 bytes per weight), so weight traffic is ~5x (INT8) to ~8x (INT4) what
the quantized bytes alone would be, and all E experts are dequantized even when few were chosen
(Mixtral 8x7B INT4 at 8 slots on an H100: 91.6 GB written a decode step, JOURNAL.md 62d; the
'kernel' path writes none, 63a).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.layers.moe_tiles import StackedExperts, kernel_swiglu, kernel_tile, tiled_swiglu


def route(router_logits: jax.Array, k: int, norm_topk_prob: bool) -> tuple[jax.Array, jax.Array]:
    """router_logits [N, E] -> (weights f32[N, k], experts i32[N, k]), experts by descending
    probability (HF's torch.topk order; ties, which random weights never hit, may differ)."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)  # (N, E)
    weights, experts = jax.lax.top_k(probs, k)  # (N, k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def expert_stack(w, dtype) -> jax.Array:
    """One layer's expert stack [E, K, N] (a plain array, a quantized-weight pytree with
    `dequantize()`, or `StackedExperts`) as a plain array in `dtype`."""
    if isinstance(w, StackedExperts):
        w = w.layer()
    if hasattr(w, "dequantize"):
        return w.dequantize().astype(dtype)
    return w.astype(dtype)


def _check(x, router_logits, w_gate, w_up, w_down, k):
    n, d = x.shape
    e, _, i = w_gate.shape
    want = {"router_logits": (n, e), "w_gate": (e, d, i), "w_up": (e, d, i), "w_down": (e, i, d)}
    got = {
        "router_logits": router_logits.shape,
        "w_gate": w_gate.shape,
        "w_up": w_up.shape,
        "w_down": w_down.shape,
    }
    for name, shape in want.items():
        if tuple(got[name]) != shape:
            raise ValueError(f"moe_mlp: {name} has shape {tuple(got[name])}, expected {shape}")
    if not 1 <= k <= e:
        raise ValueError(f"moe_mlp: k={k} experts per token must be in [1, {e}]")


def _ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """lhs [P, K] @G rhs [E, K, N] -> [P, N] (`jax.lax.ragged_dot`).

    Under a mesh with Explicit axes (the CUDA lowering check's abstract H200, a sharded engine)
    jax 0.11.2 cannot infer ragged_dot's output sharding and asks for one: the rows keep lhs's
    row sharding and N is unsharded (under expert parallelism this runs inside the shard_map,
    on one device's experts).
    """
    mesh = jax.sharding.get_abstract_mesh()
    out = None
    if not mesh.empty and jax.sharding.AxisType.Explicit in mesh.axis_types:
        spec = jax.typeof(lhs).sharding.spec
        out = jax.sharding.PartitionSpec(spec[0] if len(spec) else None, None)
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, out_sharding=out)


def moe_mlp(
    x: jax.Array,
    router_logits: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    k: int,
    norm_topk_prob: bool,
    grouped: str = "ragged_dot",
) -> jax.Array:
    """The grouped path (see the module docstring): x [N, D] -> [N, D] in x.dtype.

    w_gate, w_up [E, D, I] and w_down [E, I, D]: plain arrays or quantized stacks (anything
    `expert_stack` takes, `StackedExperts` among them). k, norm_topk_prob and grouped
    ('ragged_dot' | 'tiled' | 'kernel'; 'kernel' takes 'ragged_dot' for weights whose kernel
    does not run the tiles, float experts among them) are static.

    Expert parallelism: under a mesh whose 'model' axis has T > 1 devices dividing E (the
    partition rules then split the expert stacks over E, `parallel/partition.py`), each device
    runs only its E/T experts' pairs (`_expert_parallel`) and one all-reduce of [N, D] sums them.
    """
    _check(x, router_logits, w_gate, w_up, w_down, k)
    if grouped not in GROUPED:
        raise ValueError(f"moe_mlp: grouped={grouped!r} must be one of {GROUPED}")
    e = w_gate.shape[0]
    mesh = jax.sharding.get_abstract_mesh()
    t = mesh.shape["model"] if "model" in mesh.axis_names else 1
    split = t > 1 and e % t == 0  # expert parallelism
    ws = (w_gate, w_up, w_down)
    # the 'kernel' path's tile over each device's experts (all of them without expert parallelism)
    tile = kernel_tile(ws, x.shape[0] * k, e // t if split else e) if grouped == "kernel" else None
    if grouped == "kernel" and tile is None:
        grouped = "ragged_dot"  # weights whose kernel does not take these tiles
    if grouped == "ragged_dot" or (split and grouped == "tiled"):  # plain stacks in x.dtype
        ws = tuple(expert_stack(w, x.dtype) for w in ws)
    if split:
        return _expert_parallel(x, router_logits, *ws, k, norm_topk_prob, grouped, tile)
    weights, order, group_sizes = _dispatch(router_logits, k, norm_topk_prob, e)
    # (P, D), sorted by expert
    y = _experts(x, order, k, group_sizes, *ws, grouped=grouped, tile=tile)
    return _combine(y, order, weights).astype(x.dtype)


def _dispatch(router_logits, k: int, norm_topk_prob: bool, e: int):
    """-> (weights f32[N, k], order i32[P]: pairs sorted by expert, group_sizes i32[E])."""
    weights, experts = route(router_logits, k, norm_topk_prob)  # (N, k)
    flat = experts.reshape(-1)  # (P,) pair p = token p // k, its (p % k)-th choice
    order = jnp.argsort(flat, stable=True)  # (P,) pairs sorted by expert
    group_sizes = jnp.bincount(flat, length=e).astype(jnp.int32)  # (E,)
    return weights, order, group_sizes


GROUPED = ("ragged_dot", "tiled", "kernel")


def _experts(
    x, order, k: int, group_sizes, w_gate, w_up, w_down, shift=None, grouped="ragged_dot", tile=None
):
    """The SwiGLU of each pair's expert on its token: [P, D], rows sorted by expert. shift: the
    first sorted row of these experts' pairs (expert parallelism: the rows are rotated so they
    start at 0, and the rows past their groups come out as exact zeros). tile: the 'kernel'
    path's rows per tile (`kernel_tile`)."""
    xs = jnp.take(x, order // k, axis=0)  # (P, D)
    if shift is not None:
        xs = jnp.roll(xs, -shift, axis=0)
    if grouped in ("tiled", "kernel"):
        if grouped == "tiled":
            y = tiled_swiglu(xs, group_sizes, w_gate, w_up, w_down)
        else:
            y = kernel_swiglu(xs, group_sizes, w_gate, w_up, w_down, tile)
        return y if shift is None else jnp.roll(y, shift, axis=0)
    gate = _ragged_dot(xs, w_gate, group_sizes)  # (P, I)
    up = _ragged_dot(xs, w_up, group_sizes)  # (P, I)
    h = jax.nn.silu(gate.astype(jnp.float32)).astype(x.dtype) * up
    y = _ragged_dot(h, w_down, group_sizes)  # (P, D)
    if shift is None:
        return y
    mine = jnp.arange(y.shape[0]) < jnp.sum(group_sizes)
    return jnp.roll(jnp.where(mine[:, None], y, jnp.zeros_like(y)), shift, axis=0)


def _combine(y, order, weights) -> jax.Array:
    """Sorted pair outputs [P, D] -> f32[N, D]: unsorted, weighted and summed over each token's k."""
    n, k = weights.shape
    y = jnp.zeros_like(y).at[order].set(y, unique_indices=True)  # (P, D), pair order
    y = y.reshape(n, k, -1).astype(jnp.float32)  # (N, k, D)
    return jnp.einsum("nk,nkd->nd", weights, y)


def _expert_parallel(
    x, router_logits, w_gate, w_up, w_down, k: int, norm_topk_prob: bool, grouped: str, tile
):
    """`moe_mlp` with the experts split over the 'model' axis: every device routes all tokens
    (the router is replicated; cheap), takes the sorted pairs of its own E/T experts -- a
    contiguous run, rotated to start at row 0 -- through its experts' grouped path, and the
    per-device partial outputs (the other experts' pairs are exact zeros) are summed by one psum
    of [N, D]. Only the experts' weights are split; tokens stay replicated (no all-to-all).
    Quantized `StackedExperts` on the 'kernel' path stay in their stacks [Ls, E/T, ...]."""
    e = w_gate.shape[0]
    P = jax.sharding.PartitionSpec

    def spec(w):  # the experts' axis: 0 of a layer's [E, ...], 1 of a stack [Ls, E, ...]
        return (
            StackedExperts(P(None, "model"), P()) if isinstance(w, StackedExperts) else P("model")
        )

    def local(x, router_logits, w_gate, w_up, w_down):
        el = w_gate.shape[0]  # this device's experts: [m * el, (m + 1) * el)
        first = jax.lax.axis_index("model") * el
        weights, order, group_sizes = _dispatch(router_logits, k, norm_topk_prob, e)
        starts = jnp.cumsum(group_sizes) - group_sizes  # (E,) first sorted row of each expert
        mine = jax.lax.dynamic_slice_in_dim(group_sizes, first, el)  # (el,)
        ws, shift = (w_gate, w_up, w_down), starts[first]
        y = _experts(x, order, k, mine, *ws, shift=shift, grouped=grouped, tile=tile)
        return jax.lax.psum(_combine(y, order, weights), "model")

    out = jax.shard_map(
        local,
        in_specs=(P(), P(), spec(w_gate), spec(w_up), spec(w_down)),
        out_specs=P(),
        axis_names={"model"},
        check_vma=False,
    )(x, router_logits, w_gate, w_up, w_down)
    return out.astype(x.dtype)


def moe_mlp_reference(
    x: jax.Array,
    router_logits: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    k: int,
    norm_topk_prob: bool,
) -> jax.Array:
    """Pure-jnp reference: every expert's SwiGLU on every token, combined with the routing
    weights (zero for the experts a token did not choose). E / k times the grouped FLOPs."""
    _check(x, router_logits, w_gate, w_up, w_down, k)
    e = w_gate.shape[0]
    weights, experts = route(router_logits, k, norm_topk_prob)  # (N, k)
    combine = jnp.einsum("nk,nke->ne", weights, jax.nn.one_hot(experts, e))  # (N, E) f32
    gate = jnp.einsum("nd,edi->eni", x, w_gate)  # (E, N, I)
    up = jnp.einsum("nd,edi->eni", x, w_up)
    h = jax.nn.silu(gate.astype(jnp.float32)).astype(x.dtype) * up
    y = jnp.einsum("eni,eid->end", h, w_down).astype(jnp.float32)  # (E, N, D)
    return jnp.einsum("ne,end->nd", combine, y).astype(x.dtype)
