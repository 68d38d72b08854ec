"""Whether the C++ CPU kernels (`cpu_kernels/`) run for an engine: asked once by `ModelRunner`,
which passes the answers to `jaxserve.resolve` (host only, it imports no kernel). A kernel that
does not build leaves 'auto' on the XLA path with the compiler's reason logged; an explicit
'cpu_kernel' that cannot run is an error naming why."""

from __future__ import annotations

import logging

from jaxserve.config import KernelConfig

logger = logging.getLogger(__name__)


def attention_kernel(backend: str, kernels: KernelConfig) -> bool:
    """Whether the C++ CPU attention kernel is there to use: built only when the CPU backend's
    attention_impl asks for it ('auto' or 'cpu_kernel'); a failed build leaves 'auto' on the
    XLA 'ragged' path, with the compiler's reason logged."""
    if backend != "cpu" or kernels.attention_impl not in ("auto", "cpu_kernel"):
        return False
    from cpu_kernels import paged_decode_attention as cpu_attention

    err = cpu_attention.build_error()
    if err is not None:
        if kernels.attention_impl == "cpu_kernel":
            raise RuntimeError(f"attention_impl='cpu_kernel': the kernel is not available: {err}")
        logger.warning("CPU attention kernel not available, using 'ragged': %s", err)
    return err is None


def matmul_kernel(backend: str, kernels: KernelConfig, mesh) -> str | None:
    """The loop the C++ CPU matmul runs here ('avx512bf16', 'avx2' or 'portable';
    `cpu_kernels.matmul.path()`) when it can run for this engine: on the CPU backend, one device
    (its weights are not partitioned), built here; else None. `jaxserve.resolve` decides from the
    path whether 'auto' uses it (the AVX512-BF16 and AVX2 loops). An explicit 'cpu_kernel' that cannot
    run is an error."""
    if backend != "cpu" or kernels.matmul_impl not in ("auto", "cpu_kernel"):
        return None
    from cpu_kernels import matmul as cpu_matmul

    err = cpu_matmul.build_error()
    if kernels.matmul_impl == "cpu_kernel" and (err is not None or mesh is not None):
        reason = err or "it runs on one device only (no mesh)"
        raise RuntimeError(f"matmul_impl='cpu_kernel': the kernel cannot run: {reason}")
    if err is not None:
        logger.warning("CPU matmul kernel not available, using XLA's dot: %s", err)
        return None
    return cpu_matmul.path() if mesh is None else None
