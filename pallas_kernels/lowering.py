"""What a kernel's CUDA lowering case is, and how one is lowered for an abstract NVIDIA H200.

A leaf module (jax only): every kernel file builds its `lowering_cases()` from `KernelCheck`, and
`check.py` runs them all. No GPU is needed (see `check.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax


@dataclasses.dataclass(frozen=True)
class KernelCheck:
    name: str  # "<kernel>/<model>/<config>"
    fn: Callable  # the public kernel function, called with `args`
    args: tuple  # jax.ShapeDtypeStruct per argument (None for an absent optional argument)


def h200_mesh() -> jax.sharding.AbstractMesh:
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    return jax.sharding.AbstractMesh(
        (1,), ("x",), (jax.sharding.AxisType.Explicit,), abstract_device=dev
    )


def lower_for_h200(check: KernelCheck) -> str:
    """StableHLO text of the case lowered for CUDA; raises whatever the lowering raises."""
    with jax.sharding.use_abstract_mesh(h200_mesh()):
        lowered = jax.jit(check.fn).trace(*check.args).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    if "triton" not in text:
        raise RuntimeError("lowered module holds no Triton custom call")
    return text


def kernel_launches(jaxpr, prefix: str) -> int:
    """Pallas calls named `prefix...` that running `jaxpr` (a `jax.make_jaxpr(...).jaxpr`)
    launches, each call site counted (a jitted function called twice holds its jaxpr twice)."""
    n = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            n += str(eqn.params["name"]).startswith(prefix)
            continue
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
                if hasattr(sub, "eqns"):
                    n += kernel_launches(sub, prefix)
    return n
