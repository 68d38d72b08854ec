"""Quantized weights under tensor parallelism: partition specs and the local kernel in shard_map.

XLA partitions a plain weight's dot by itself. A quantized weight is several arrays in a packed
layout, and its kernels (the Pallas INT4 matmul above all) are single-device programs, so each
weight class says how its leaves split (`partition_specs(role)`) and `matmul`/`take` run the
local kernel under `jax.shard_map` over the mesh's 'model' axis:

    role      weight [.., K, N]        x [.., K]          local              result [.., N]
    column    N split  (leaves' N)     replicated         x @ W[:, shard]    split on N
    row       K split  (leaves' K/G)   split on K         x[shard] @ W[shard, :] (f32)
                                                                             psum -> replicated
    take (an embedding [D, V], vocab-parallel = column): each device looks up the ids it holds
              (others read 0) and a psum gathers the rows: exact, one nonzero term per row.

A weight carries its role as the static field `parallel` ('column' / 'row', set by the partition
rules when they place it). Nothing changes without a mesh, with 'model' of size 1, with
`parallel=None`, or inside a shard_map that is already manual over 'model' (the leaves are then
local). Only 'model' is made manual (`axis_names`): other axes ('data') stay as the caller's
shardings have them.

Each class supplies `_local_fields(role, T)`: the static fields of its per-device weight (an INT4
column shard of a `shards = T` weight is a `shards = 1` weight; a per-channel INT8 row shard has
group_size K/T), raising ValueError naming the numbers when the weight cannot split that way.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

AXIS = "model"
ROLES = ("column", "row", "replicated")
PARALLEL = (None, "column", "row")


def axis_size(axis: str = AXIS) -> int:
    """Size of `axis` in the current mesh (`jax.set_mesh`); 1 without one, without that axis, or
    when it is already manual (inside a shard_map over it)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or axis not in mesh.axis_names or axis in mesh.manual_axes:
        return 1
    return int(mesh.shape[axis])


def check_role(role: str, allowed=ROLES) -> None:
    if role not in allowed:
        raise ValueError(f"partition role must be one of {allowed}, got {role!r}")


def check_parallel(parallel) -> None:
    if parallel not in PARALLEL:
        raise ValueError(f"parallel must be one of {PARALLEL}, got {parallel!r}")


def spec(ndim: int, axis: str | None, dim: int) -> P:
    """PartitionSpec of an ndim array with `axis` on dimension `dim` (negative: from the end)."""
    parts = [None] * ndim
    if axis is not None:
        parts[dim] = axis
    return P(*parts)


def spec_size(size: int | None, axis: str) -> int | None:
    """The axis size to check a split against: `size`, else the current mesh's (None: no mesh)."""
    if size is not None:
        return size
    t = axis_size(axis)
    return t if t > 1 else None


def row_group_check(k: int, t: int, group_size: int) -> None:
    if k % t or (k // t) % group_size:
        raise ValueError(
            f"row-parallel split of K={k} over T={t} devices must fall on group boundaries: "
            f"(K/T) % group_size == 0 fails for group_size={group_size}"
        )


def _manual_axes(axis: str) -> frozenset:
    """The axes the shard_map makes manual: `axis`, and every other Explicit axis of the mesh
    (an Explicit axis left automatic around a Pallas call trips its interpreter and its refs)."""
    mesh = jax.sharding.get_abstract_mesh()
    return frozenset({axis, *mesh.explicit_axes}) - frozenset(mesh.manual_axes)


def _batch_spec(a: jax.Array, manual: frozenset, axis: str) -> list:
    """Per dim of `a`: its Explicit sharding over the manual axes other than `axis` (an Auto
    axis says nothing here, and stays automatic)."""
    sharding = getattr(jax.typeof(a), "sharding", None)
    parts = list(getattr(sharding, "spec", ()) or ())
    parts += [None] * (a.ndim - len(parts))

    def keep(entry):
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        names = tuple(n for n in names if n in manual and n != axis)
        return None if not names else names[0] if len(names) == 1 else names

    return [keep(e) for e in parts]


def _shard_map(body, in_specs, out_specs, manual: frozenset, axis: str):
    """shard_map over the manual axes. Inputs on an Explicit 'model' axis are first resharded to
    in_specs (shard_map takes Explicit inputs only as their type says; Auto ones it reshards)."""
    # check_vma=False: the local kernels are single-device programs (a Pallas call's output
    # carries no varying-axes type), and each body states its own collective.
    fn = jax.shard_map(
        body, in_specs=in_specs, out_specs=out_specs, axis_names=set(manual), check_vma=False
    )
    if axis not in jax.sharding.get_abstract_mesh().explicit_axes:
        return fn

    def call(*args):
        is_spec = lambda s: isinstance(s, P)
        args = jax.tree.map(
            lambda s, a: jax.sharding.reshard(a, s), in_specs, args, is_leaf=is_spec
        )
        return fn(*args)

    return call


def _local(w, role: str, t: int):
    fields = w._local_fields(role, t)
    return lambda wl: dataclasses.replace(wl, parallel=None, **fields)


def matmul(w, x: jax.Array, layer, local_matmul, axis: str = AXIS) -> jax.Array:
    """x[..., K] @ w -> [..., N] in x.dtype, under shard_map over `axis` when the mesh splits it.

    local_matmul(w, x, layer, out_dtype): the single-device matmul of the weight class. x keeps
    its batch sharding over the other axes ('data'); only its last dim's split is set here.
    """
    t = axis_size(axis)
    if t == 1 or w.parallel is None:
        return local_matmul(w, x, layer, x.dtype)
    role = w.parallel
    local = _local(w, role, t)
    specs = w.partition_specs(role, axis, size=t)
    manual = _manual_axes(axis)
    lead = _batch_spec(x, manual, axis)[:-1]  # x's batch dims, as the caller sharded them
    split, whole = P(*lead, axis), P(*lead, None)
    args = (w, x) if layer is None else (w, x, layer)
    layer_spec = () if layer is None else (P(),)

    if role == "column":

        def body(wl, xl, *lay):  # xl [..., K], wl [.., K, N/T] -> [..., N/T]
            return local_matmul(local(wl), xl, lay[0] if lay else None, x.dtype)

        in_specs, out_specs = (specs, whole, *layer_spec), split
    else:

        def body(wl, xl, *lay):  # xl [..., K/T], wl [.., K/T, N] -> partial [..., N] f32
            y = local_matmul(local(wl), xl, lay[0] if lay else None, jnp.float32)
            return jax.lax.psum(y, axis).astype(x.dtype)

        in_specs, out_specs = (specs, split, *layer_spec), whole
    return _shard_map(body, in_specs, out_specs, manual, axis)(*args)


def take(w, ids: jax.Array, dtype, local_take, axis: str = AXIS) -> jax.Array:
    """Columns W[:, ids].T -> [..., K] in dtype (an embedding lookup), under shard_map when the mesh
    splits `axis`. local_take(w, ids, dtype): the single-device gather of the weight class."""
    t = axis_size(axis)
    if t == 1 or w.parallel is None:
        return local_take(w, ids, dtype)
    ids = jnp.asarray(ids)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"{type(w).__name__}.take: ids must be integers, got {ids.dtype}")
    role = w.parallel
    local = _local(w, role, t)
    specs = w.partition_specs(role, axis, size=t)
    manual = _manual_axes(axis)
    n = w.shape[-1]
    ids = jnp.clip(ids.astype(jnp.int32), 0, n - 1)  # the clamp of one device, before splitting
    lead = _batch_spec(ids, manual, axis)

    if role == "column":  # vocab-parallel: this device holds columns [s*N/T, (s+1)*N/T)
        nl = n // t

        def body(wl, idl):
            loc = idl - jax.lax.axis_index(axis) * nl  # (...,)
            mine = (loc >= 0) & (loc < nl)
            rows = local_take(local(wl), jnp.where(mine, loc, 0), jnp.float32)  # (..., K)
            rows = jnp.where(mine[..., None], rows, 0.0)
            return jax.lax.psum(rows, axis).astype(dtype)  # one nonzero term per row: exact

        out_specs = P(*lead, None)
    else:  # row: this device holds rows [s*K/T, (s+1)*K/T) of every column

        def body(wl, idl):
            return local_take(local(wl), idl, dtype)  # (..., K/T)

        out_specs = P(*lead, axis)
    return _shard_map(body, (specs, P(*lead)), out_specs, manual, axis)(w, ids)
