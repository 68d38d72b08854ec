"""Configuration, host only (no jax): what a model is, and how an engine serves it.

    model_fields.py  the leaves: architecture names, RopeScaling, size bounds and their checks
    hf.py            a Hugging Face config.json -> ModelConfig's fields
    presets.py       named model shapes, as data (name -> ModelConfig's fields)
    model.py         ModelConfig: frozen and hashable (a jit static argument); from_hf, PRESETS
    checks.py        the checks a setting declares beside its default, and the loop running them
    settings.py      every engine setting with its default, help text and check
    speculative.py   vLLM's speculative_config and batch-size schedule -> the speculative settings
    groups.py        the settings in groups, one frozen dataclass per part's concern (CacheConfig,
                     SchedulerConfig, ...), built from the `group=` each setting declares
    engine.py        EngineConfig: the settings, the rules between them, for_model, the groups
    gpu_choices.py   the GPU kernel table (gpu_kernel_choices.toml): 'auto' per chip and rows bucket

The shape, as vLLM's (EngineArgs -> VllmConfig): the flat settings are the user's surface
(`LLM(model, **settings)`, the launch flags, the server, in vLLM's spellings); `EngineConfig`
takes them flat, checks them, and is filled once for the model (`for_model`); the engine's parts
read them as grouped sub-configs of the filled config (`config.cache`, `config.scheduler`,
`config.parallel`, `config.speculative`, `config.lora`, `config.kernels`, `config.load`, ...),
each part taking the group(s) it reads, never a flat field.

Import from here: `from jaxserve.config import EngineConfig, ModelConfig`. Which implementations
and buckets a built engine uses is jaxserve/resolve.py's choice, made from a filled EngineConfig.
"""

from jaxserve.config.engine import EngineConfig
from jaxserve.config.groups import (
    CacheConfig,
    CompilationConfig,
    KernelConfig,
    LoadConfig,
    LoRAConfig,
    ParallelConfig,
    RequestConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from jaxserve.config.model import PRESETS, ModelConfig
from jaxserve.config.model_fields import SUPPORTED_ARCHITECTURES, RopeScaling
from jaxserve.config.settings import (
    ATTENTION_IMPLS,
    BATCHINGS,
    DTYPES,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    MATMUL_IMPLS,
    MAX_LOGPROBS,  # noqa: F401  (core/sampling_params.py and resolve.py import it from here)
    QUANT_MATMUL_IMPLS,
)

__all__ = [
    "ATTENTION_IMPLS",
    "MATMUL_IMPLS",
    "QUANT_MATMUL_IMPLS",
    "BATCHINGS",
    "CacheConfig",
    "CompilationConfig",
    "DTYPES",
    "EngineConfig",
    "KernelConfig",
    "LoadConfig",
    "LoRAConfig",
    "ParallelConfig",
    "RequestConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
    "KV_CACHE_DTYPES",
    "LOAD_FORMATS",
    "PRESETS",
    "SUPPORTED_ARCHITECTURES",
    "ModelConfig",
    "RopeScaling",
]
