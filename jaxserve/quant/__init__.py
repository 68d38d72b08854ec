"""Post-training weight quantization: the packed layouts and `quantize_params`.

    quantize_params(params, config, method, group_size, calib=None) -> params

returns the same pytree with every linear weight (layers/{wq, wk, wv, wo, w_gate, w_up, w_down}
[L, K, N], and lm_head [D, V] when untied) replaced by a quantized-weight pytree of the same logical
shape (`Int4Weight`, `Int8Weight`, `Fp8Weight`); norms and biases keep the model dtype.
Mixture-of-experts models: the expert stacks layers/{we_gate, we_up, we_down} [Ls, E, K, N]
quantize like any linear (per expert: the scales keep the [Ls, E] axes) and the MoE layer
dequantizes one layer's stack inside the step (`layers/moe.py`); the router [Ls, D, E] is
deliberately left in the model dtype (E outputs: tiny, and it decides which experts run); w_gate /
w_up / w_down exist only for the dense layers. AWQ / GPTQ refuse MoE configs (their calibration
collects one input statistic per linear, not per expert).
`layers.linear.linear` calls `w.matmul(x)`, so the model runs unchanged (an INT4 stack is
handed to its kernel whole, `w.matmul(x, layer=l)`, which reads layer l in place).

The embedding table [V, D] is quantized too (`quantize_embedding=True`, the default) in the lm_head
view [D, V] (`layers/embedding.py`): the model looks rows up with `embed.take(ids)` and, when tied
(SmolLM2), the same quantized table computes the logits. Why default on: the table is 6.5% of
Llama-3-8B's bf16 bytes and 21% of SmolLM2's; left in bf16 it keeps an INT4-g128 model at 0.31x of
bf16 instead of <= 0.27x. Why optional: a tied table is also the output projection, whose error
shows most in the logits (llama.cpp keeps output.weight at higher precision in its 4-bit mixes), so
`quantize_embedding=False` (bf16 table) or `embedding_method="int8"` trades bytes back for quality.

`with_matmul_impl(params, impl, kernel_rows)` sets every quantized weight's matmul implementation
and the rows its kernel takes, static choices: the weights default to 'xla' (runs everywhere) and
the engine's runner calls this once with its backend's choice (on GPU the GPU kernel table's row
for its chip: `resolve`; 'xla' elsewhere); tests force 'pallas_interpret' on CPU.
GGUF Q4_0/Q4_1/Q8_0 files import without re-quantizing: `load_model(path, quantization=
"gguf-native")` (`jaxserve/loading/gguf_native.py`; loading imports quant, never the reverse).

Methods live in `METHODS`: name -> fn(params, config, group_size, calib) -> params. Per-weight
methods (RTN, INT8, FP8) are built with `per_weight(fn)`; calibration-based ones (AWQ, GPTQ) see
the whole model and register one line each.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from jaxserve.config import ModelConfig, gpu_choices
from jaxserve.layers.embedding import is_quantized
from jaxserve.quant import awq, gptq, int4, int8, rtn
from jaxserve.quant.int4 import Int4Weight, pack, unpack
from jaxserve.quant.int8 import Fp8Weight, Int8Weight

LAYER_WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
MOE_EXPERT_WEIGHTS = ("we_gate", "we_up", "we_down")  # the router stays float
QUANTIZED_TYPES = (Int4Weight, Int8Weight, Fp8Weight)


def linear_weight_names(params: dict, config: ModelConfig) -> list[str]:
    """Paths ('layers/wq', ..., 'lm_head') of the weights `quantize_params` replaces."""
    # --- mixture-of-experts: dense MLP weights only where there are dense layers; expert stacks
    names = [
        f"layers/{n}"
        for n in LAYER_WEIGHTS
        if config.dense_layers or n not in ("w_gate", "w_up", "w_down")
    ]
    if config.moe_layers:
        names += [f"layers/{n}" for n in MOE_EXPERT_WEIGHTS]
    # --- end mixture-of-experts ---
    if not config.tie_word_embeddings:
        names.append("lm_head")
    for name in names:
        if _get(params, name) is None:
            raise ValueError(f"params have no linear weight {name!r}")
    return names


def _get(params: dict, name: str):
    node = params
    for part in name.split("/"):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def replace_weights(params: dict, new: dict[str, object]) -> dict:
    """A copy of params with the weights at the given 'a/b' paths replaced."""
    out = jax.tree_util.tree_map(lambda x: x, params, is_leaf=lambda x: not isinstance(x, dict))
    for name, w in new.items():
        *parents, leaf = name.split("/")
        node = out
        for p in parents:
            node[p] = dict(node[p])
            node = node[p]
        node[leaf] = w
    return out


def check_group_size(params: dict, config: ModelConfig, group_size: int) -> None:
    """Raises ValueError naming the first linear weight whose input dim group_size does not divide."""
    if group_size not in int4.GROUP_SIZES:
        raise ValueError(f"group_size must be one of {int4.GROUP_SIZES}, got {group_size}")
    for name in linear_weight_names(params, config):
        shape = tuple(_get(params, name).shape)
        if shape[-2] % group_size:
            raise ValueError(
                f"group_size {group_size} does not divide the input dim of {name} "
                f"(shape {shape}: in={shape[-2]}, out={shape[-1]})"
            )


def per_weight(fn: Callable[[jax.Array, int], object], grouped: bool = True) -> Callable:
    """Lifts fn(w[..., K, N], group_size) -> quantized weight into a whole-params method."""

    def method(params: dict, config: ModelConfig, group_size: int, calib=None) -> dict:
        if grouped:
            check_group_size(params, config, group_size)
        names = linear_weight_names(params, config)
        return replace_weights(params, {n: fn(_get(params, n), group_size) for n in names})

    return method


METHODS: dict[str, Callable[[dict, ModelConfig, int, object], dict]] = {
    "int4-rtn": per_weight(lambda w, g: rtn.quantize_int4_rtn(w, g, symmetric=True)),
    "int4-rtn-asym": per_weight(lambda w, g: rtn.quantize_int4_rtn(w, g, symmetric=False)),
    "int8": per_weight(lambda w, g: int8.quantize_int8(w), grouped=False),
    "fp8": per_weight(lambda w, g: int8.quantize_fp8(w), grouped=False),
}


# The calibrated methods expose only the options `quantize_params` documents.
def _awq(params, config, group_size, calib):
    return awq.quantize_awq(params, config, group_size, calib)


def _gptq(params, config, group_size, calib, act_order=False, refine_config=None):
    return gptq.quantize_gptq(
        params, config, group_size, calib, act_order=act_order, refine_config=refine_config
    )


METHODS["int4-awq"] = _awq
METHODS["int4-gptq"] = _gptq


# How each method quantizes the embedding table in its lm_head view w[D, V] (in = D): RTN for all
# (no calibration statistic describes both uses of a tied table); asymmetric for the calibrated
# INT4 methods, as `calibration.quantize_lm_head` does for an untied lm_head.
EMBEDDING_METHODS: dict[str, Callable[[jax.Array, int], object]] = {
    "int4-rtn": lambda w, g: rtn.quantize_int4_rtn(w, g, symmetric=True),
    "int4-rtn-asym": lambda w, g: rtn.quantize_int4_rtn(w, g, symmetric=False),
    "int4-awq": lambda w, g: rtn.quantize_int4_rtn(w, g, symmetric=False),
    "int4-gptq": lambda w, g: rtn.quantize_int4_rtn(w, g, symmetric=False),
    "int8": lambda w, g: int8.quantize_int8(w),
    "fp8": lambda w, g: int8.quantize_fp8(w),
}


def check_embedding(params: dict, method: str, group_size: int | None) -> None:
    """Raises ValueError unless `quantize_embedding_table` can quantize params["embed"].

    group_size None skips the group check (the input dim D is wq's too, so the method names it).
    """
    table = params["embed"]
    if is_quantized(table):
        raise ValueError(f"embed is already quantized ({type(table).__name__})")
    if method not in EMBEDDING_METHODS:
        raise ValueError(
            f"no embedding quantizer for method {method!r} (known: {sorted(EMBEDDING_METHODS)}); "
            "pass quantize_embedding=False to keep the table in the model dtype"
        )
    v, d = table.shape  # (V, D)
    if method.startswith("int4"):
        if group_size is not None and d % group_size:
            raise ValueError(
                f"group_size {group_size} does not divide the input dim of embed "
                f"(lm_head view [D, V] = {(d, v)}: in={d})"
            )
        if v % int4.PACK:
            raise ValueError(
                f"embed: vocab size {v} is not a multiple of {int4.PACK}, so the INT4 lm_head view "
                f"[D, V] cannot be packed; pass quantize_embedding=False"
            )


def quantize_embedding_table(params: dict, method: str, group_size: int) -> dict:
    """params with embed [V, D] replaced by its quantized lm_head view [D, V] (see module doc)."""
    check_embedding(params, method, group_size)
    table = params["embed"].T  # (D, V)
    return replace_weights(params, {"embed": EMBEDDING_METHODS[method](table, group_size)})


# Each weight type's op in the GPU kernel table (config/gpu_kernel_choices.toml), whose row
# limit `with_matmul_impl` sets, and the limit it has when none is given.
KERNEL_ROWS = {
    Int4Weight: ("int4_matmul", int4.PALLAS_MAX_ROWS),
    Int8Weight: ("w8_matmul", int8.PALLAS_MAX_ROWS),
    Fp8Weight: ("w8_matmul", int8.PALLAS_MAX_ROWS),
}


def with_matmul_impl(params: dict, impl: str, kernel_rows=()) -> dict:
    """params with every quantized weight's `impl` replaced (one of `int4.IMPLS`, the same names
    as the W8A16 kernel's; see `Int4Weight`, `Int8Weight`), and its `kernel_rows`: the rows up
    to which a kernel impl runs its kernel (XLA's path above), from `kernel_rows`, {op: rows} or
    ((op, rows), ...) over the GPU table's matmul ops (`Resolved.quant_kernel_rows`), else the
    type's default (KERNEL_ROWS).

    Float leaves are returned untouched. Works on abstract params (`jax.eval_shape` output) too:
    only the static fields change.
    """
    if impl not in int4.IMPLS:
        raise ValueError(f"impl must be one of {int4.IMPLS}, got {impl!r}")
    rows = dict(kernel_rows)
    if set(rows) - set(gpu_choices.MATMUL_OPS):
        raise ValueError(f"kernel_rows names ops of {gpu_choices.MATMUL_OPS}, got {sorted(rows)}")

    def set_impl(w):
        op, default = KERNEL_ROWS[type(w)]
        return w.replace(impl=impl, kernel_rows=rows.get(op, default))

    return jax.tree.map(
        lambda w: set_impl(w) if isinstance(w, QUANTIZED_TYPES) else w,
        params,
        is_leaf=lambda w: isinstance(w, QUANTIZED_TYPES),
    )


# The row-parallel linears of tensor parallelism (`jaxserve.parallel.partition.ROLES`): their
# input dim is split over the devices, so a group must not straddle two devices' slices.
ROW_PARALLEL = ("wo", "w_down")


def default_group_size(params: dict, config: ModelConfig, row_shards: int = 1) -> int:
    """The largest supported group size (128, else 64, else 32) dividing every linear's input dim
    (for the row-parallel ones, each of `row_shards` tensor-parallel slices of it).

    SmolLM2's 576-wide inputs give 64. Raises ValueError when even 32 does not divide one.
    """

    def rows(name):
        k = _get(params, name).shape[-2]
        return k // row_shards if name.split("/")[-1] in ROW_PARALLEL else k

    for g in sorted(int4.GROUP_SIZES, reverse=True):
        if all(rows(n) % g == 0 for n in linear_weight_names(params, config)):
            return g
    g = min(int4.GROUP_SIZES)
    for n in linear_weight_names(params, config):
        if row_shards > 1 and rows(n) % g and _get(params, n).shape[-2] % g == 0:
            raise ValueError(
                f"{n}: its input dim {_get(params, n).shape[-2]} split over "
                f"tensor_parallel_size={row_shards} devices leaves {rows(n)} rows per device, "
                f"which no INT4 group size {int4.GROUP_SIZES} divides"
            )
    check_group_size(params, config, min(int4.GROUP_SIZES))  # raises, naming the weight
    raise AssertionError("unreachable")


def quantize_params(
    params: dict,
    config: ModelConfig,
    method: str,
    group_size: int | None = None,
    calib=None,
    quantize_embedding: bool = True,
    embedding_method: str | None = None,
    row_shards: int = 1,
    **method_options,
) -> dict:
    """Quantizes the linear weights of a float params pytree (see the module docstring).

    group_size applies to the INT4 methods (32, 64 or 128, along the input dim; one that does not
    divide a weight's input dim raises ValueError naming it); None picks `default_group_size`
    (128 when it divides every input dim). INT8/FP8 are per-output-channel.
    calib: calibration data for methods that need it (AWQ, GPTQ).
    quantize_embedding: also quantize the embedding table (lm_head view, RTN; see module doc).
    embedding_method: the table's format (an `EMBEDDING_METHODS` key; None: "int8" for a tied
      table, else `method`'s own). E.g.
      "int8" keeps a tied table's logits near float while the layers are INT4 (SmolLM2, GPL-3
      text: INT4-g64 layers ppl 33.1 with a float or INT8 table, 37.0 with an INT4-g64 table).
    method_options: passed to the method (int4-gptq: `act_order`, `refine_config`); a method that
      takes none, given some, raises TypeError.
    """
    if method not in METHODS:
        raise ValueError(f"unknown quantization method {method!r}; known: {sorted(METHODS)}")
    if config.num_experts and method in ("int4-awq", "int4-gptq"):
        raise ValueError(
            f"{method} does not support mixture-of-experts models (num_experts="
            f"{config.num_experts}): its calibration has no per-expert statistics; use int4-rtn, "
            "int8 or fp8"
        )
    if group_size is None:  # row_shards: the tensor parallelism INT4 weights will run under
        group_size = default_group_size(
            params, config, row_shards if method.startswith("int4") else 1
        )
    for name in linear_weight_names(params, config):
        if isinstance(_get(params, name), QUANTIZED_TYPES):
            raise ValueError(f"{name} is already quantized")
    # A tied table is also the lm_head: INT4 there costs SmolLM2 ~12% perplexity, INT8 ~0%.
    embedding_method = embedding_method or ("int8" if config.tie_word_embeddings else method)
    if quantize_embedding:
        check_embedding(params, embedding_method, None)  # before the (possibly long) method runs
    out = METHODS[method](params, config, group_size, calib, **method_options)
    if not quantize_embedding:
        return out
    return quantize_embedding_table(out, embedding_method, group_size)


__all__ = [
    "EMBEDDING_METHODS",
    "METHODS",
    "check_embedding",
    "Fp8Weight",
    "Int4Weight",
    "Int8Weight",
    "check_group_size",
    "default_group_size",
    "linear_weight_names",
    "pack",
    "per_weight",
    "quantize_embedding_table",
    "quantize_params",
    "replace_weights",
    "unpack",
    "with_matmul_impl",
]
