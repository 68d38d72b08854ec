"""Host-side helpers shared by the loaders: parameter paths, dtypes, stacking, moving to device.

A parameter path is the '/'-joined key path of `models.llama.param_shapes`: "embed", "layers/wq",
"final_norm", "lm_head". Loaders fill a flat {path: numpy array} dict (layer tensors copied into
one preallocated [L, ...] array, in the file's float dtype), then `to_device` moves it to the
device, casts it to the requested dtype and checks it against the config.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import DTYPES, ModelConfig
from jaxserve.models.llama import check_params, param_shapes


def np_dtype(dtype: str) -> np.dtype:
    """'float32' | 'bfloat16' -> the numpy dtype (bfloat16 from ml_dtypes, as jnp uses)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    return np.dtype(jnp.float32) if dtype == "float32" else np.dtype(jnp.bfloat16)


def flat_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """{path: logical shape} for every parameter of `config`, layer params with their [L] axis."""
    out = {}
    for key, shape in param_shapes(config).items():
        if isinstance(shape, dict):
            out.update({f"{key}/{k}": s for k, s in shape.items()})
        else:
            out[key] = shape
    return out


def to_device(flat: dict, config: ModelConfig, dtype: str | None = None, mesh=None) -> dict:
    """Nests {path: host array} into the params pytree of jax arrays; checks every shape.

    With `dtype`, float arrays are cast on the device (numpy's bfloat16 casts are several times
    slower than XLA's); other leaves (quantized-weight pytrees) are moved as they are.
    With a ('data', 'model') `mesh`, each host array goes straight onto its devices, split as the
    partition rules say (`parallel.partition.load_spec`): a device receives only its slice, so a
    model larger than one device loads. Quantized pytrees go to the default device; the runner
    places them.
    """
    dt = None if dtype is None else np_dtype(dtype)
    place = None
    if mesh is not None:
        from jaxserve.parallel.partition import placer

        place = placer(config, mesh)
    params: dict = {}
    for path, arr in flat.items():
        node = params
        *parents, leaf = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        plain = isinstance(arr, np.ndarray | jax.Array)
        x = place(path, arr) if place is not None and plain else jax.device_put(arr)
        if dt is not None and isinstance(x, jax.Array) and x.dtype != dt:
            x = x.astype(dt)
        node[leaf] = x
    check_params(params, config)
    return params
