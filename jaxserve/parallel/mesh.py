"""The device mesh: ('data', 'model') = (data_parallel_size, tensor_parallel_size).

    make_mesh(tensor_parallel_size, data_parallel_size, devices=None) -> Mesh
    check_tensor_parallel(model_config, tensor_parallel_size)          the divisibility rules
    mesh_sizes(mesh) -> (data, model)                                  of any user-given mesh

Both axes are `AxisType.Auto`: XLA propagates the params' shardings through the step (GSPMD),
the way one writes a jax program for many devices without annotating every intermediate.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxserve.config.model import ModelConfig

AXES = ("data", "model")


def make_mesh(tensor_parallel_size: int = 1, data_parallel_size: int = 1, devices=None) -> Mesh:
    """A (data, model) mesh over the first D x T devices (of every process: jax.devices())."""
    t, d = tensor_parallel_size, data_parallel_size
    devices = list(jax.devices() if devices is None else devices)
    if d * t > len(devices):
        raise ValueError(
            f"data_parallel_size ({d}) x tensor_parallel_size ({t}) = {d * t} devices, but only "
            f"{len(devices)} are available ({devices[0].platform})"
        )
    grid = np.array(devices[: d * t], dtype=object).reshape(d, t)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto, AxisType.Auto))


def mesh_sizes(mesh) -> tuple[int, int]:
    """(data, model) sizes of a mesh; a user's mesh must name both axes (size 1 allowed)."""
    missing = [a for a in AXES if a not in mesh.axis_names]
    if missing or len(mesh.axis_names) != 2:
        raise ValueError(
            f"a jaxserve mesh has exactly the axes {AXES} (size 1 allowed); got "
            f"{tuple(mesh.axis_names)} (e.g. jax.make_mesh((D, T), {AXES}))"
        )
    return int(mesh.shape["data"]), int(mesh.shape["model"])


def check_tensor_parallel(config: ModelConfig, t: int) -> None:
    """ValueError naming the numbers unless T splits the model evenly: T divides the query heads
    and the MLP width; the KV heads divide T (each replicated T / KVH times, as vLLM does) or T
    divides them."""
    if t == 1:
        return
    h, kvh, inter = config.num_heads, config.num_kv_heads, config.intermediate_size
    if h % t:
        raise ValueError(f"tensor_parallel_size ({t}) must divide the model's query heads ({h})")
    if inter % t:
        raise ValueError(
            f"tensor_parallel_size ({t}) must divide the model's MLP width "
            f"(intermediate_size {inter})"
        )
    if t > kvh and t % kvh:
        raise ValueError(
            f"tensor_parallel_size ({t}) exceeds the KV heads ({kvh}) but is not a multiple of "
            f"them, so they cannot be replicated evenly"
        )
    if t < kvh and kvh % t:
        raise ValueError(f"tensor_parallel_size ({t}) must divide the model's KV heads ({kvh})")
