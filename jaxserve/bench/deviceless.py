"""Compiling a jitted function for an NVIDIA GPU on a machine without one (deviceless XLA:GPU).

    target("h100" | "h200" | path to a GpuTargetConfigProto text) -> GpuTarget
    gpu_mesh(target, tensor_parallel_size, data_parallel_size) -> Mesh of compile-only devices
    compile_for_gpu(fn, args, static, mesh, compiler_options) -> GpuProgram

XLA runs its whole GPU pipeline here (fusion, GEMM rewrites, scheduling, buffer assignment, PTX and
cubin, the thunk sequence the runtime will launch) against a `GpuTargetConfigProto` describing the
chip, with no GPU and no driver. What it cannot do without a device is autotune: GEMM backends and
tiles are XLA's defaults. Everything else (which kernels, copies and cuBLAS calls run, in which
command buffers, inside which loops) is what the GPU gets, so tests hold the GPU path to its design
on every CPU run, and the rare GPU minutes go to timing what the CPU already proved.

What it needs (the `gpu-compile` extra): `jax-cuda12-plugin` and `jax-cuda12-pjrt` of jax's version,
`nvidia-cuda-nvcc-cu12` (ptxas, libdevice) and `nvidia-cuda-runtime-cu12` (XLA loads cudart while
emitting some thunks); and `JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1` before jax starts its backends (the
plugin's start-up check calls `cuInit`, which fails without a driver). `prepare()` sets it; after
that jax still runs on the CPU (the CUDA client fails to start and jax falls back, quietly).

The target configs in `gpu_targets/` are XLA's own (`xla/backends/gpu/target_config/specs/`),
with the CUDA stack a GPU engine runs on: a `driver_version` (without one XLA assumes 0.0.0 and
keeps cuBLAS out of command buffers), and the runtime and toolkit of jax's CUDA plugin, 12.9 (the
specs say 12.8; XLA records a dynamic-slice fusion, cuBLAS reading a layer of its stack in place,
into a CUDA graph only when all three are 12.9 or newer: JOURNAL.md 64a). A GPU run saves the
device's own (`experiments/gpu_checks.sh`), which `target(path)` reads.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

TARGETS_DIR = Path(__file__).parent / "gpu_targets"
NAMED_TARGETS = {"h100": "h100_sxm.txtpb", "h200": "h200.txtpb"}
SKIP_CHECK = "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"


@dataclasses.dataclass(frozen=True)
class CudaStack:
    """The CUDA versions a target names (e.g. "12.9.0"): what XLA decides some graph captures by."""

    driver: str
    runtime: str
    toolkit: str  # what XLA was compiled with


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """One chip XLA compiles for: its GpuTargetConfigProto text and what the report needs."""

    name: str
    config_text: str
    device_kind: str  # e.g. "NVIDIA H100 80GB HBM3"
    memory_bandwidth: float  # bytes/s, the HBM roofline of a memory-bound step
    num_cores: int  # streaming multiprocessors
    memory_bytes: int  # the chip's memory, which the KV pool and slot state must fit in
    cuda: CudaStack

    def describe(self) -> str:
        c = self.cuda
        return (
            f"{self.device_kind} (CUDA driver {c.driver}, runtime {c.runtime}, toolkit {c.toolkit})"
        )


def target(name_or_path: str) -> GpuTarget:
    """'h100', 'h200', or the path of a GpuTargetConfigProto text file (e.g. one a GPU saved)."""
    path = (
        Path(TARGETS_DIR / NAMED_TARGETS[name_or_path]) if name_or_path in NAMED_TARGETS else None
    )
    if path is None:
        path = Path(name_or_path)
        if not path.is_file():
            raise ValueError(
                f"GPU target {name_or_path!r} is neither {sorted(NAMED_TARGETS)} nor a file"
            )
    text = path.read_text()

    def field(key: str, cast=str):
        m = re.search(rf"^\s*{key}:\s*\"?([^\"\n]+)\"?\s*$", text, re.M)
        if not m:
            raise ValueError(f"{path}: no {key} field (is it a GpuTargetConfigProto text?)")
        return cast(m.group(1))

    return GpuTarget(
        name=name_or_path,
        config_text=text,
        device_kind=field("name"),
        memory_bandwidth=field("memory_bandwidth", float),
        num_cores=field("core_count", int),
        memory_bytes=field("device_memory_size", int),
        cuda=CudaStack(
            driver=field("driver_version"),
            runtime=field("runtime_version"),
            toolkit=field("compile_time_toolkit_version"),
        ),
    )


def missing() -> str | None:
    """Why a deviceless GPU compile cannot run here (a sentence naming the package), or None."""
    need = {
        "jax_plugins.xla_cuda12": "jax-cuda12-plugin",
        "nvidia.cuda_nvcc": "nvidia-cuda-nvcc-cu12",
        "nvidia.cuda_runtime": "nvidia-cuda-runtime-cu12",
    }
    for module, package in need.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            return (
                f"deviceless GPU compiles need {package} (pip install -e '.[gpu-compile]', "
                "jax's version of the CUDA plugin)"
            )
    return None


def prepare() -> None:
    """Sets what the CUDA plugin needs to start without a driver. Call before jax starts its
    backends (before the first jax.devices() / computation); raises if it is too late or the
    packages are missing."""
    reason = missing()
    if reason:
        raise RuntimeError(reason)
    os.environ.setdefault(SKIP_CHECK, "1")
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized() and os.environ.get(SKIP_CHECK) != "1":
        raise RuntimeError(f"set {SKIP_CHECK}=1 before jax starts (deviceless GPU compiles)")


def gpu_mesh(target: GpuTarget, tensor_parallel_size: int = 1, data_parallel_size: int = 1):
    """A ('data', 'model') Mesh (the engine's `parallel.mesh.make_mesh`) of compile-only GPUs of
    `target`: D x T of them, in one process."""
    prepare()
    from jax.experimental import topologies

    from jaxserve.parallel.mesh import make_mesh

    n = tensor_parallel_size * data_parallel_size
    topo = topologies.get_topology_desc(
        platform="cuda", topology=f"1x1x{n}", target_config=target.config_text
    )
    return make_mesh(tensor_parallel_size, data_parallel_size, topo.devices)


@dataclasses.dataclass
class GpuProgram:
    """One compiled GPU program: what XLA built and how long it took."""

    name: str
    hlo: str  # the optimized, scheduled HLO module (compiled.as_text())
    thunks: str  # the thunk sequence the runtime executes (after XLA's thunk passes)
    thunk_names: dict[int, str]  # thunk id -> the HLO instruction it runs (profile annotation)
    compile_s: float
    compiler_options: dict[str, str]


def compile_for_gpu(
    name: str,
    fn: Callable,
    args: tuple,
    static: dict,
    mesh,
    compiler_options: dict[str, str] | None = None,
) -> GpuProgram:
    """Traces `fn` (a jax.jit function) with abstract `args` (ShapeDtypeStructs carrying
    NamedShardings on `mesh`) and `static` keywords, lowers it for CUDA and compiles it for the
    mesh's GPUs with XLA `compiler_options` (added to any the jit function has). Nothing is read from or written to the persistent compilation cache (a hit
    would skip the compile being inspected)."""
    import jax
    from jax._src import config as jax_config

    options = dict(compiler_options or {})
    dump = tempfile.mkdtemp(prefix="jaxserve-gpu-compile-")
    try:
        with jax.set_mesh(mesh), jax_config.enable_compilation_cache(False):
            lowered = fn.trace(*args, **static).lower(lowering_platforms=("cuda",))
            t0 = time.perf_counter()
            compiled = lowered.compile(
                compiler_options={**options, "xla_dump_to": dump, "xla_dump_hlo_as_text": "True"}
            )
            seconds = time.perf_counter() - t0
        files = {p.name: p for p in Path(dump).iterdir()}

        def read(*suffixes: str) -> str:
            # the last module dumped is the program (a trace can compile helpers first); the
            # first suffix found (XLA writes the sequence after its thunk passes only when they
            # changed it)
            for suffix in suffixes:
                found = sorted(n for n in files if n.endswith(suffix))
                if found:
                    return files[found[-1]].read_text()
            raise RuntimeError(f"XLA wrote no *{suffixes[-1]} for {name} (dump: {sorted(files)})")

        hlo = compiled.as_text()
        thunks = read("thunk_sequence_after_thunk_passes.txt", "thunk_sequence.txt")
        meta = read("thunk_metadata.txt")
    finally:
        shutil.rmtree(dump, ignore_errors=True)
    names = {
        int(i): a for a, i in re.findall(r'profile_annotation: "([^"]*)"\s*thunk_id: (\d+)', meta)
    }
    return GpuProgram(name, hlo, thunks, names, seconds, options)
