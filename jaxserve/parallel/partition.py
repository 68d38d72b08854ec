"""The partition rules, in one table keyed like the params (`models.llama.param_shapes`), and the
placement of params, KV pool and slot state on a ('data', 'model') mesh.

    ROLES                                  param name -> role
    replicate_kv_heads(params, config, T)  -> (params, config): KV heads copied up to T
                                              (`kv_columns` + `take_kv_columns`, and
                                              `replicated_config`)
    param_specs(params, config, T)         -> (params, specs): PartitionSpec pytree for `params`
                                              (quantized weights repacked/tagged for their role)
    shard_params(params, config, mesh)     -> params on the mesh (each device gets its slice only)
    cache_specs(cache) / state_specs(...)  -> the pool's and the slot state's PartitionSpecs

Roles (T = the 'model' axis size; every leading stacked-layer axis unsharded):

    column      wq wk wv w_gate w_up   [.., in, out]: out split    (Megatron column-parallel)
                bq bk bv lm_head       [.., out]: out split; lm_head [D, V]: vocab split
    row         wo w_down              [.., in, out]: in split -> XLA adds the all-reduce
    vocab       embed [V, D]           rows split (a quantized table, stored [D, V]: columns)
    expert      we_gate we_up we_down  [Ls, E, ..]: experts split (expert parallelism,
                                       `layers/moe.py`); replicated when T does not divide E
    replicated  norms, and any param without a rule (a new family's extra tensors), logged

Logits come out split over the vocabulary; sampling (a softmax, top-k/top-p over V) makes XLA
gather them, which is as far as sampling needs. A vocabulary that T does not divide keeps embed
and lm_head replicated (logged). The KV pool [L, KVH, P, ps, Dh] is split over its KV heads.

Plain weights are partitioned by XLA from these shardings. A quantized weight takes its role
statically (`w.parallel`) and runs its kernel per device under `jax.shard_map` (`jaxserve.quant`);
an INT4 column weight is repacked so each device's columns are one contiguous packed block
(`Int4Weight.shards`, the layout diagram in `pallas_kernels/int4_layout.py`).
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.config.model import ModelConfig
from jaxserve.layers.embedding import is_quantized
from jaxserve.layers.linear import TransposedWeight
from jaxserve.parallel.mesh import check_tensor_parallel, mesh_sizes

logger = logging.getLogger(__name__)

AXIS = "model"
ROLES = {
    "wq": "column",
    "wk": "column",
    "wv": "column",
    "w_gate": "column",
    "w_up": "column",
    "bq": "column",
    "bk": "column",
    "bv": "column",
    "wo": "row",
    "w_down": "row",
    "lm_head": "column",
    "embed": "vocab",
    "we_gate": "expert",  # [Ls, E, D, Im] split over E: expert parallelism (layers/moe.py)
    "we_up": "expert",
    "we_down": "expert",
}


def role_of(name: str) -> str:
    """The role of param `name` (its last path component); unknown and norm params replicate."""
    return ROLES.get(name, "replicated")


def lora_specs(stacks: dict) -> dict:
    """PartitionSpecs of the LoRA adapters' stacks (`layers/lora.py`: a [L, in, N, R],
    b [L, N, R, out]): each factor splits with its base weight, so a device reads only its
    share. A column-parallel weight's b splits its outputs (a is whole: the input is); a
    row-parallel weight's a splits its inputs (b is whole), so the shrink's partial sums add up
    across devices as the base weight's do."""
    specs = {}
    for name in stacks:
        role = role_of(name)
        if role == "column":
            specs[name] = {"a": P(), "b": P(None, None, None, AXIS)}
        elif role == "row":
            specs[name] = {"a": P(None, AXIS, None, None), "b": P()}
        else:
            raise ValueError(f"no LoRA sharding rule for {name!r} (role {role!r})")
    return specs


# -- KV-head replication ----------------------------------------------------------------------------
def kv_head_map(config: ModelConfig, t: int) -> np.ndarray | None:
    """For T > KVH: the source KV head of each of the T new heads (head j <- j // (T / KVH)), so
    query head i still reads a copy of its KV head i // (H / KVH). None when nothing replicates."""
    kvh = config.num_kv_heads
    if t <= kvh:
        return None
    return np.arange(t) // (t // kvh)


def _take_columns(w, cols: np.ndarray):
    if is_quantized(w):
        return w.take_columns(cols)
    return jnp.take(w, jnp.asarray(cols), axis=-1)


def kv_columns(config: ModelConfig, t: int) -> np.ndarray | None:
    """The wk / wv (bk / bv) output columns each of the T replicated KV heads copies, head j's
    from head `kv_head_map[j]` (None: nothing replicates). An adapter's columns follow them."""
    heads = kv_head_map(config, t)
    if heads is None:
        return None
    dh = config.head_dim
    return (heads[:, None] * dh + np.arange(dh)[None, :]).reshape(-1)


def replicated_config(config: ModelConfig, t: int) -> ModelConfig:
    """`config` with its KV heads copied up to T where T exceeds them (vLLM's rule)."""
    if kv_head_map(config, t) is None:
        return config
    logger.info(
        "tensor_parallel_size %d > %d KV heads: each KV head replicated %d times",
        t,
        config.num_kv_heads,
        t // config.num_kv_heads,
    )
    return dataclasses.replace(config, num_kv_heads=t)


def take_kv_columns(params: dict, cols: np.ndarray | None) -> dict:
    """`params` with wk / wv (and bk / bv) reduced to columns `cols` (`kv_columns`; None: as
    they are). Exact: columns are copied, quantized ones without requantizing."""
    if cols is None:
        return params
    layers = dict(params["layers"])
    for name in ("wk", "wv", "bk", "bv"):
        if name in layers:
            layers[name] = _take_columns(layers[name], cols)
    return {**params, "layers": layers}


def replicate_kv_heads(params: dict, config: ModelConfig, t: int) -> tuple[dict, ModelConfig]:
    """(params, config) with the KV heads copied up to T when T exceeds them: `take_kv_columns`
    of `kv_columns`, and `replicated_config`."""
    return take_kv_columns(params, kv_columns(config, t)), replicated_config(config, t)


# -- specs --------------------------------------------------------------------------------------------
def _plain_spec(role: str, ndim: int, transposed: bool) -> P:
    """The spec of a plain array of logical shape [..., in, out] (or [..., out] for a bias)."""
    spec = [None] * ndim
    if role == "column":
        spec[-2 if transposed else -1] = AXIS
    elif role == "row":
        spec[-1 if transposed else -2] = AXIS
    elif role == "vocab":  # the embedding table [V, D]
        spec[0] = AXIS
    return P(*spec)


def _expert_spec(a) -> P:
    """An expert stack leaf [Ls, E, ...] (plain, or a quantized weight's packed / scales / mins,
    which carry the same leading axes): split over E."""
    return P(None, AXIS, *([None] * (a.ndim - 2)))


def _leaf_spec(name: str, w, role: str, t: int):
    """(the weight, its spec pytree) for one param under T-way tensor parallelism."""
    if role == "replicated":
        return w, jax.tree.map(lambda _: P(), w)
    if role == "expert":
        return w, jax.tree.map(_expert_spec, w)
    if is_quantized(w):
        qrole = "column" if role == "vocab" else role  # a quantized table is stored [D, V]
        if hasattr(w, "shards") and qrole == "column" and w.shards != t:
            from jaxserve.quant.int4 import repack

            w = repack(w, t)
        w = w.replace(parallel=qrole)
        return w, w.partition_specs(qrole, axis=AXIS, size=t)
    if isinstance(w, TransposedWeight):
        return w, TransposedWeight(_plain_spec(role, w.t.ndim, transposed=True))
    return w, _plain_spec(role, w.ndim, transposed=False)


def param_specs(params: dict, config: ModelConfig, t: int) -> tuple[dict, dict]:
    """(params, specs): the PartitionSpec of every leaf of `params` (same pytree structure), with
    quantized weights repacked and tagged for their role. T must pass `check_tensor_parallel`
    and the KV heads must already be replicated up to T (`replicate_kv_heads`)."""
    check_tensor_parallel(config, t)
    vocab_split = config.vocab_size % t == 0
    if not vocab_split:
        logger.info(
            "vocab %d is not a multiple of T=%d: embed/lm_head replicated", config.vocab_size, t
        )
    out_params, specs, unruled = {}, {}, []

    experts_split = bool(config.num_experts) and config.num_experts % t == 0
    if config.num_experts and not experts_split and t > 1:
        logger.info("%d experts are not a multiple of T=%d: replicated", config.num_experts, t)

    def one(name, w):
        role = role_of(name) if t > 1 else "replicated"
        if role == "vocab" or name == "lm_head":
            role = role if vocab_split else "replicated"
        if role == "expert" and not experts_split:
            role = "replicated"
        if name not in ROLES and "norm" not in name:
            unruled.append(name)
        return _leaf_spec(name, w, role, t)

    for name, w in params.items():
        if name == "layers":
            out_params["layers"], specs["layers"] = {}, {}
            for lname, lw in w.items():
                out_params["layers"][lname], specs["layers"][lname] = one(lname, lw)
        else:
            out_params[name], specs[name] = one(name, w)
    if unruled and t > 1:
        logger.info("params without a partition rule, replicated: %s", sorted(unruled))
    return out_params, specs


def shard_params(params: dict, config: ModelConfig, mesh) -> dict:
    """`params` placed on `mesh`: split over 'model' by the rules, replicated over 'data'. Each
    device receives only its slice (`jax.device_put` of a host or single-device array to a
    NamedSharding transfers each device its shard)."""
    _, t = mesh_sizes(mesh)
    params, specs = param_specs(params, config, t)
    return jax.tree.map(place, params, named(mesh, specs))


def place(x, sharding: NamedSharding) -> jax.Array:
    """One array onto `sharding`, each device getting only its slice. Within one process that is
    `jax.device_put`; across processes each builds its devices' shards from its host copy
    (`jax.make_array_from_callback`), as every process holds the same weights. An array that
    already spans processes (loaded straight onto the mesh, `load_spec`) has no host copy to
    take: it is resharded on the devices, every process running the same program."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if x.sharding.is_equivalent_to(sharding, x.ndim):
            return x
        return jax.jit(lambda a: a, out_shardings=sharding)(x)
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def cache_specs(cache, data_axis: bool = False):
    """The KV pool's specs: [L, KVH, P, ps, Dh] split over KV heads (and pages over 'data' when
    data_axis)."""
    spec = P(None, AXIS, "data" if data_axis else None)
    return jax.tree.map(lambda _: spec, cache)


def replicated(tree):
    """Specs replicating every leaf of `tree` (the slot state under tensor parallelism)."""
    return jax.tree.map(lambda _: P(), tree)


def named(mesh, specs):
    """PartitionSpec pytree -> NamedSharding pytree on `mesh`."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


# -- pinning the donated state inside the steps -------------------------------------------------------
def _auto_axes() -> dict[str, int]:
    """The context mesh's automatic axes of size > 1 (inside a shard_map its manual ones are
    gone from view); {} without a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return {}
    manual = jax.sharding.AxisType.Manual
    return {
        name: size
        for name, size, kind in zip(mesh.axis_names, mesh.axis_sizes, mesh.axis_types)
        if size > 1 and kind != manual
    }


def pin_slots(state):
    """The slot state with its canonical sharding: slots split over 'data' (where that axis is
    automatic, i.e. outside the data-parallel shard_map), replicated over 'model'. Without this,
    XLA may hand a donated leaf back split differently (e.g. the [S, V] masks over 'model'), and
    the next step would compile again for the new input sharding."""
    axes = _auto_axes()
    if not axes:
        return state
    spec = P("data" if "data" in axes else None)
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, spec), state)


def pin_replicated(x: jax.Array) -> jax.Array:
    """`x` [..., V] whole on every device of the automatic axes: the logits, computed split over
    the vocabulary and gathered once, before sampling (whose top-k/top-p and token-count updates would otherwise run split
    over the vocabulary and gather the [S, V] counts every step)."""
    axes = _auto_axes()
    if not axes:
        return x
    if AXIS in axes and x.shape[-1] % axes[AXIS] == 0:  # computed split (lm_head's columns),
        x = jax.lax.with_sharding_constraint(x, P(*[None] * (x.ndim - 1), AXIS))
    return jax.lax.with_sharding_constraint(x, P())  # then gathered: never the weight


def pin_cache(cache):
    """The KV pool with its canonical sharding: KV heads split over 'model'."""
    axes = _auto_axes()
    if "model" not in axes:
        return cache
    spec = P(None, AXIS, "data" if "data" in axes else None)
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, spec), cache)


# -- placing tensors as they load ---------------------------------------------------------------------
def load_spec(path: str, ndim: int, config: ModelConfig, t: int) -> P:
    """The spec a tensor gets straight from the file, by its param path ("layers/wq", or a
    quantized weight's array "layers/wq/packed"): its role's split, so no device ever holds it
    whole. K/V projections stay whole when T exceeds the KV heads (the runner copies heads)."""
    parts = path.split("/")
    name = parts[1] if parts[0] == "layers" and len(parts) > 1 else parts[0]
    role = role_of(name) if t > 1 else "replicated"
    if name in ("wk", "wv", "bk", "bv") and t > config.num_kv_heads:
        role = "replicated"
    if name in ("embed", "lm_head") and config.vocab_size % t:
        role = "replicated"
    if role == "expert":  # [Ls, E, ...], whether plain or a quantized weight's array
        if config.num_experts % t:
            return P()
        return P(None, AXIS, *([None] * (ndim - 2)))
    quantized_array = len(parts) > (2 if parts[0] == "layers" else 1)
    if quantized_array and role == "vocab":  # a quantized table is stored [D, V]
        role = "column"
    return _plain_spec(role, ndim, transposed=False)


def placer(config: ModelConfig, mesh):
    """place(path, host_array) -> the array on `mesh` under `load_spec` (the loaders' hook)."""
    _, t = mesh_sizes(mesh)

    def place_one(path: str, x):
        return place(x, NamedSharding(mesh, load_spec(path, np.ndim(x), config, t)))

    return place_one
