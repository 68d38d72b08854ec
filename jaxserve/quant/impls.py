"""The quantized weights' matmul implementations: a static field (`impl`) of every INT4 / INT8 /
FP8 weight, set once when the engine is built (`quant.with_matmul_impl`, from `resolve`).

    'xla'               unpack / convert + dot: every backend (the weights' default)
    'reference'         the f32 jnp definition
    'pallas'            the Pallas Triton kernels (`pallas_kernels/int4_matmul.py`, `w8_matmul.py`)
                        on a decode batch's rows; GPU
    'pallas_interpret'  the same, interpreted (CPU tests)
    'mgpu'              the Pallas Mosaic GPU kernels (Hopper: `pallas_kernels/mgpu_w8_matmul.py`,
                        `mgpu_w4_matmul.py`) where they take the call (bf16 activations, their
                        tile multiples: `check_mgpu_*_inputs`), else the Triton kernel; GPU
    'mgpu_interpret'    the same in Mosaic GPU's and Pallas' interpreters (CPU tests)

Above each kernel's row limit (a prefill chunk: compute-bound) every kernel impl takes XLA's path:
the weights' static `kernel_rows`, set with the impl (`quant.with_matmul_impl`) from the engine's
GPU's row of the GPU kernel table (`config/gpu_kernel_choices.toml`), by default each format's
`PALLAS_MAX_ROWS`.
"""

from __future__ import annotations

from pallas_kernels.int4_matmul import IMPLS as KERNEL_IMPLS
from pallas_kernels.mgpu_common import accepts as mgpu_accepts

MGPU_IMPLS = ("mgpu", "mgpu_interpret")
IMPLS = (*KERNEL_IMPLS, *MGPU_IMPLS)
KERNELS = ("pallas", "pallas_interpret", *MGPU_IMPLS)  # the impls that run a kernel


def check_kernel_rows(name: str, rows) -> None:
    """ValueError unless `rows` (a weight's `kernel_rows`) is an int >= 0."""
    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 0:
        raise ValueError(f"{name}.kernel_rows must be an int >= 0, got {rows!r}")


def triton_twin(impl: str) -> str:
    """The Triton kernel's impl that serves a call the Mosaic GPU kernel refuses."""
    return {"mgpu": "pallas", "mgpu_interpret": "pallas_interpret"}.get(impl, impl)


__all__ = ["IMPLS", "KERNELS", "MGPU_IMPLS", "check_kernel_rows", "mgpu_accepts", "triton_twin"]
