"""Linear layers over plain or quantized weights.

A weight is either a plain array `[in, out]` (x @ w) or a weight pytree that knows how to multiply
itself (`w.matmul(x)`): a quantized weight from `jaxserve.quant`, or a `TransposedWeight` (a plain
weight stored `[out, in]`, what the runner uses on CPU). Layers never look inside such a weight:
a packed layout is defined once, in `jaxserve/quant/`. A `FusedWeight` (the runner's GPU layout)
holds weights that share an input as one (plain, or 8-bit per-channel): the model multiplies its
`w` once and `split`s the product.
"""

import math

import jax
import jax.numpy as jnp

from cpu_kernels import matmul as cpu_matmul


def matmul(
    x: jax.Array, w: jax.Array, *, transposed: bool = False, out_dtype=None, min_rows: int = 1
) -> jax.Array:
    """x[..., in] @ w -> [..., out]; w is [in, out], or [out, in] with `transposed`.

    out_dtype: the dot's result type (e.g. f32 accumulation for logits); default x.dtype.

    min_rows (static; `ModelImpl.min_matmul_rows`, 4 on CPU): fewer rows are padded up to it
    (zero rows, sliced off after). Why on CPU:
    - XLA's CPU backend sends a one-row bf16 dot to a generic emitter that first converts the
      whole weight to f32; SmolLM2's tied logits for one prefill chunk took 43 ms as one row and
      4 ms as two (`experiments/JOURNAL.md` section 17);
    - from 4 rows up its GEMM gives a row the same bits whatever the other rows (section 16), so
      a one-chunk prefill samples its first token from the same logits as a chunk among others.
    A padded dot costs what the unpadded one does: these shapes are bound by reading the weight.
    """
    x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    m = x2.shape[0]
    if m < min_rows:
        x2 = jnp.pad(x2, ((0, min_rows - m), (0, 0)))
    spec = "ni,oi->no" if transposed else "ni,io->no"
    y = jnp.einsum(spec, x2, w, preferred_element_type=out_dtype)[:m]
    return y.reshape(*x.shape[:-1], y.shape[-1])


@jax.tree_util.register_pytree_node_class
class TransposedWeight:
    """A plain weight of logical shape [..., in, out] stored as `t` = [..., out, in].

    PyTorch's nn.Linear layout. XLA's CPU GEMM multiplies SmolLM2's 30-layer projection stack
    1.17x faster at 32 rows (1.42x at 4) with the weights stored this way
    (JOURNAL.md section 21), so `ModelRunner` stores plain layer
    weights like this on CPU (`cpu_layout`, chosen by `jaxserve.resolve`). Slicing a stack
    (`lax.scan`, `linear(layer=)`) slices `t` on its leading axes: the layer axis stays first.

    kernel (static): True for a bf16 weight multiplied by the C++ CPU matmul
    (`cpu_kernels/matmul.py`), whatever the number of rows: one implementation for every batch,
    so a row gets the same bits in a decode step as in any prefill step (batch invariance).
    Such a stack reads its layer in place (`reads_layer_in_place`: `lax.scan` passes it whole,
    with the layer index), where XLA would copy the layer out first.
    """

    def __init__(self, t: jax.Array, kernel: bool = False):
        self.t = t
        self.kernel = kernel

    @classmethod
    def of(cls, w: jax.Array, kernel: bool = False) -> "TransposedWeight":
        """From a weight stored [..., in, out] (one copy of it)."""
        return cls(jnp.swapaxes(w, -1, -2), kernel)  # eager: a new, transposed buffer

    def tree_flatten(self):
        return (self.t,), self.kernel

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, aux)

    @property
    def reads_layer_in_place(self) -> bool:
        return self.kernel

    @property
    def shape(self) -> tuple[int, ...]:  # the logical [..., in, out]
        return (*self.t.shape[:-2], self.t.shape[-1], self.t.shape[-2])

    @property
    def dtype(self):
        return self.t.dtype

    def matmul(self, x: jax.Array, min_rows: int = 1, layer=None, out_dtype=None) -> jax.Array:
        """x[..., in] @ the weight (layer `layer` of the stack when given) -> [..., out] in
        out_dtype (default x.dtype)."""
        t = self.t
        if self.kernel and x.dtype == jnp.bfloat16 == t.dtype:
            return cpu_matmul.matmul(x, t, 0 if layer is None else layer, out_dtype or x.dtype)
        if layer is not None:
            t = jax.lax.dynamic_index_in_dim(t, layer, keepdims=False)
        return matmul(x, t.astype(x.dtype), transposed=True, out_dtype=out_dtype, min_rows=min_rows)


@jax.tree_util.register_pytree_node_class
class FusedWeight:
    """Weights that share an input (q, k and v; gate and up) as one weight `w` of logical shape
    [..., in, sum(outs)] (a plain array, or an 8-bit per-channel weight): one GEMM or one W8A16
    kernel launch computes them all (`fuse_projections`).

    outs (static): each weight's output width, in order; `split` cuts the GEMM's output back
    into them. Slicing a stack (`lax.scan`) slices `w` on its leading axes.
    """

    def __init__(self, w: jax.Array, outs: tuple[int, ...]):
        self.w = w
        self.outs = tuple(outs)

    def tree_flatten(self):
        return (self.w,), self.outs

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, aux)

    @property
    def reads_layer_in_place(self) -> bool:  # a kernel reading the stack's layer itself
        return getattr(self.w, "reads_layer_in_place", False)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.w.shape

    @property
    def dtype(self):
        return self.w.dtype

    def split(self, y: jax.Array) -> tuple[jax.Array, ...]:
        """y[..., sum(outs)] (x @ w) -> each weight's product y[..., out]."""
        starts = [sum(self.outs[:i]) for i in range(len(self.outs))]
        return tuple(y[..., s : s + n] for s, n in zip(starts, self.outs))


# The weights of a layer that share an input, in the order `projs` asks for them
# (`models/llama.decoder_layer`, `models/mlp.dense_mlp`).
FUSED_GROUPS = (("wq", "wk", "wv"), ("w_gate", "w_up"))


def fused_name(names) -> str:
    """The layer-weights key of a fused group: "wq+wk+wv"."""
    return "+".join(names)


def _fusable(layers: dict, names, num_layers: int) -> list | None:
    """The group's weights if all are stacks of every layer, of one input width and one kind:
    plain [num_layers, in, out] arrays (or their shapes) of one dtype, or 8-bit per-channel
    weights (`quant/int8.py`, `concat_out`) of one type and impl; else None (INT4, biases, a
    mixed model's dense stacks of some layers only)."""
    ws = [layers.get(n) for n in names]
    if any(w is None or len(w.shape) != 3 for w in ws) or ws[0].shape[0] != num_layers:
        return None
    if len({(w.shape[:2], type(w), w.dtype if _is_array(w) else None) for w in ws}) != 1:
        return None
    if _is_array(ws[0]) or getattr(ws[0], "per_channel", False):
        return ws
    return None


def _is_array(w) -> bool:
    return isinstance(w, jax.Array | jax.ShapeDtypeStruct)


def _bytes(w) -> int:
    return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(w))


def fusion_bytes(layers: dict, num_layers: int) -> int:
    """Bytes of the largest stack `fuse_projections` writes while its group's stacks still
    live: what the layout needs beyond the weights themselves (0 if nothing would be fused)."""
    sizes = [
        sum(_bytes(w) for w in ws)
        for names in FUSED_GROUPS
        if (ws := _fusable(layers, names, num_layers))
    ]
    return max(sizes, default=0)


def fuse_projections(layers: dict, num_layers: int) -> dict:
    """The model's layer weights with each group of `FUSED_GROUPS` whose weights `_fusable`
    takes (plain stacks, or 8-bit per-channel ones) replaced by one `FusedWeight` under
    `fused_name(group)` (a new, concatenated buffer; the separate stacks are dropped). Other
    weights stay as they are."""
    out = dict(layers)
    for names in FUSED_GROUPS:
        ws = _fusable(out, names, num_layers)
        if ws is None:
            continue
        for n in names:
            del out[n]
        outs = tuple(w.shape[-1] for w in ws)
        if isinstance(ws[0], jax.ShapeDtypeStruct):  # abstract params (the lowering tests)
            fused = jax.ShapeDtypeStruct((*ws[0].shape[:-1], sum(outs)), ws[0].dtype)
        elif isinstance(ws[0], jax.Array):
            fused = jnp.concatenate(ws, axis=-1)
        else:
            fused = ws[0].concat_out(ws[1:])
        out[fused_name(names)] = FusedWeight(fused, outs)
    return out


def cpu_layout(layers: dict, kernel: bool = False) -> dict:
    """The model's layer weights with every plain stacked linear weight ([L, in, out] array) as a
    `TransposedWeight` (bf16 ones with `kernel`: multiplied by the C++ CPU matmul);
    norms, biases and quantized weights unchanged."""
    return {
        name: transposed(w, kernel) if isinstance(w, jax.Array) and w.ndim == 3 else w
        for name, w in layers.items()
    }


def transposed(w: jax.Array, kernel: bool = False) -> TransposedWeight:
    """A plain weight [..., in, out] as a `TransposedWeight`; `kernel` only for bf16 weights."""
    return TransposedWeight.of(w, kernel and w.dtype == jnp.bfloat16)


def linear(x: jax.Array, w, layer=None, min_rows: int = 1) -> jax.Array:
    """x[..., in] @ w[in, out] -> [..., out] in x.dtype.

    min_rows: see `matmul` (plain and transposed weights; quantized ones multiply themselves).

    layer (i32[] or int): w is a stack [L, in, out] and the weight is its layer `layer`. A weight
    whose kernel reads a stack's layer in place (`reads_layer_in_place`: INT4, and a
    `TransposedWeight` for the C++ CPU matmul) gets the stack whole; any other is sliced out here.
    """
    if layer is not None and not getattr(w, "reads_layer_in_place", False):
        w = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, layer, keepdims=False), w)
        layer = None
    if isinstance(w, jax.Array):
        return matmul(x, w.astype(x.dtype), min_rows=min_rows)
    if isinstance(w, TransposedWeight):
        return w.matmul(x, min_rows=min_rows, layer=layer)
    return w.matmul(x) if layer is None else w.matmul(x, layer=layer)


def linears(x: jax.Array, ws, layer=None, min_rows: int = 1) -> tuple[jax.Array, ...]:
    """`linear(x, w, layer, min_rows)` for each w of `ws` (x's projections: q, k and v; gate and
    up). Weights that are all multiplied by the C++ CPU matmul run as one kernel call
    (`cpu_matmul.matmul_many`: the same bits, one wake-up of the threads instead of one per
    weight); any others one by one."""
    if x.dtype == jnp.bfloat16 and all(
        isinstance(w, TransposedWeight) and w.kernel and w.dtype == jnp.bfloat16 for w in ws
    ):
        return cpu_matmul.matmul_many(x, [w.t for w in ws], 0 if layer is None else layer)
    return tuple(linear(x, w, layer=layer, min_rows=min_rows) for w in ws)
