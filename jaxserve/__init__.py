"""jaxserve: LLM inference on JAX/XLA with Pallas kernels, a paged KV cache and continuous batching.

    from jaxserve import LLM, SamplingParams
    llm = LLM()                                   # SmolLM2-135M-Instruct (fetched from PyPI)
    out = llm.generate(["Hello"], SamplingParams(max_tokens=32))[0].outputs[0].text

`LLM` is imported lazily so that host-only modules (scheduler, allocator, requests, batch jobs)
can be imported without loading jax.
"""

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.structured_outputs import StructuredOutputsParams

__all__ = [
    "LLM",
    "AsyncLLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "EngineConfig",
    "ModelConfig",
    "RequestOutput",
    "CompletionOutput",
    "RequestMetrics",
]


def __getattr__(name: str):
    if name == "LLM":
        from jaxserve.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from jaxserve.entrypoints.async_llm import AsyncLLM

        return AsyncLLM
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
