"""How `LLM(...)`'s keyword arguments become an engine, the one build path of every front door
(`LLM`, `AsyncLLM`, the launchers and benchmarks through them):

build_engine(model, mesh=None, **settings) -> BuiltEngine
    settings (EngineConfig's fields, vLLM's spellings) -> EngineConfig, checked before anything
    loads -> the mesh (made here, once, unless the caller holds one; its `parallel` group) ->
    the weights (its `load` group), straight onto their shards -> the config filled for the
    model (once), whose groups the parts read (`config.scheduler`, `config.cache`, ...) -> the KV
    budget -> the runner's blueprint (`runner.blueprint.blueprint`: the backend's choices, the KV
    heads under TP, the pool's pages) -> ModelRunner -> LLMEngine. The runner and the engine
    take these finished objects and derive no config or mesh of their own.

vllm_settings(settings) -> (settings, VllmOptions)   max_num_seqs, block_size, dtype aliases,
                                                     speculative_config; gpu_memory_utilization,
                                                     tokenizer, generation_config
generation_defaults(model, generation_config)        default sampling params of the model
kv_budget_bytes / apply_memory_utilization           vLLM's KV budget on an accelerator
mesh_settings(mesh, settings)                        a user's mesh -> the parallel sizes
"""

from __future__ import annotations

import dataclasses
import logging
import os

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.config.speculative import merge_speculative_config
from jaxserve.core.engine import LLMEngine
from jaxserve.core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
_SETTINGS = frozenset(f.name for f in dataclasses.fields(EngineConfig))


@dataclasses.dataclass(frozen=True)
class BuiltEngine:
    """What `build_engine` made: the engine, and what a front door reports of it."""

    engine: LLMEngine
    engine_config: EngineConfig  # filled for the model; the parallel sizes are the mesh's
    model_config: ModelConfig  # with generation_config.json's eos ids added
    tokenizer: object | None  # None for dummy weights without one
    source: str  # what was loaded
    num_pages: int  # the KV pool's pages (fewer where the GPU kernels need it)
    default_sampling_params: SamplingParams | None  # generation_config.json's, or None
    warmup_seconds: float | None  # None unless built with warmup=True


def build_engine(model: str | ModelConfig | None = None, *, mesh=None, **settings) -> BuiltEngine:
    """The engine of `LLM(model, mesh=mesh, **settings)` (see the module docstring). TypeError
    for an unknown setting, ValueError naming a bad value (before the model loads, except a
    max_model_len beyond the model's)."""
    from jaxserve.loading import load_model  # lazy: loading pulls in transformers and jax
    from jaxserve.runner.blueprint import blueprint
    from jaxserve.runner.runner import ModelRunner

    settings, vllm = vllm_settings(settings)  # vLLM's names -> EngineConfig's
    for name in settings:
        if name not in _SETTINGS:
            raise TypeError(f"LLM() got an unexpected keyword argument {name!r}")
    if mesh is not None:
        settings = mesh_settings(mesh, settings)
    requested = EngineConfig(model=model, **settings)  # fails here, before the model loads
    load, parallel = requested.load, requested.parallel
    t, d = parallel.tensor_parallel_size, parallel.data_parallel_size
    if mesh is None and t * d > 1:
        from jaxserve.parallel.mesh import make_mesh

        mesh = make_mesh(t, d)  # before loading: tensors go straight onto their shards
    loaded = load_model(
        load.model,
        dtype=load.dtype,
        load_format=load.load_format,
        quantization=load.quantization,
        tensor_parallel_size=t,
        mesh=mesh,
        revision=load.revision,
        token=vllm.hf_token,
    )
    config = loaded.config
    gen = generation_defaults(loaded.source, vllm.generation_config)  # a Hub id's snapshot
    if gen.get("eos_token_ids"):  # vLLM adds generation_config's eos ids as stop ids
        eos = tuple(sorted(set(config.eos_token_ids) | set(gen.pop("eos_token_ids"))))
        config = dataclasses.replace(config, eos_token_ids=eos)
    gen.pop("eos_token_ids", None)
    engine_config = requested.for_model(config)  # the one place the config is filled
    if vllm.gpu_memory_utilization is not None:
        engine_config = apply_memory_utilization(
            engine_config, config, loaded.params, vllm.gpu_memory_utilization
        )
    tokenizer = loaded.tokenizer
    if vllm.tokenizer is not None:
        tokenizer = _tokenizer(vllm.tokenizer, vllm.hf_token)
    runner = ModelRunner(loaded.params, blueprint(loaded.params, config, engine_config, mesh=mesh))
    engine = LLMEngine(runner, config, engine_config, runner.num_pages, tokenizer=tokenizer)
    return BuiltEngine(
        engine=engine,
        engine_config=engine_config,
        model_config=config,
        tokenizer=tokenizer,
        source=loaded.source,
        num_pages=runner.num_pages,
        default_sampling_params=SamplingParams(**gen) if gen else None,
        warmup_seconds=runner.warmup() if engine_config.compilation.warmup else None,
    )


def _tokenizer(source: str, token):
    """The tokenizer of `tokenizer=`: a folder, or a Hub id's tokenizer files only."""
    from jaxserve.loading import hub
    from jaxserve.loading.tokenizer import load_tokenizer

    path = (
        hub.resolve(source, token=token, tokenizer_only=True) if hub.is_repo_id(source) else source
    )
    tokenizer = load_tokenizer(path)
    if tokenizer is None:
        raise ValueError(f"tokenizer: no tokenizer files in {source}")
    return tokenizer


@dataclasses.dataclass(frozen=True)
class VllmOptions:
    """vLLM constructor options with no EngineConfig field of their own."""

    gpu_memory_utilization: float | None = None
    tokenizer: str | None = None
    generation_config: str = "auto"
    hf_token: str | bool | None = None  # for Hub ids (else HF_TOKEN or the saved login)


# vLLM constructor arguments that have no meaning in jaxserve: name -> (whether a value changes
# nothing here, why). Such a value is accepted with a logged note; any other would silently mean
# something else, and is refused naming the argument.
_ANY = lambda v: True
_OFF = lambda v: not v
VLLM_NO_OPS = {
    "enforce_eager": (_ANY, "every step is one compiled XLA program (no CUDA-graph toggle)"),
    "trust_remote_code": (_ANY, "jaxserve runs its own code for the families it supports"),
    "code_revision": (_ANY, "no remote code is run"),
    "disable_log_stats": (_ANY, "stats are kept on the host (LLM.stats())"),
    "swap_space": (_ANY, "preemption recomputes; nothing is swapped to the host"),
    "max_seq_len_to_capture": (_ANY, "no CUDA-graph capture sizes"),
    "disable_custom_all_reduce": (_ANY, "collectives are XLA's"),
    "compilation_config": (_ANY, "XLA compiles the steps (see compilation_cache)"),
    "distributed_executor_backend": (_ANY, "one SPMD program over a jax Mesh"),
    "disable_async_output_proc": (_ANY, "outputs are processed on the host between steps"),
    "served_model_name": (_ANY, "a server setting; LLM serves no name"),
    "enable_chunked_prefill": (lambda v: v in (None, True), "prefill is always chunked"),
    "tokenizer_mode": (lambda v: v in ("auto", "hf"), "the Hugging Face tokenizer is used"),
    "task": (lambda v: v in ("auto", "generate"), "jaxserve generates text only"),
    "runner": (lambda v: v in ("auto", "generate"), "jaxserve generates text only"),
    "pipeline_parallel_size": (
        lambda v: v == 1,
        "no pipeline parallelism (use tensor_parallel_size)",
    ),
    "skip_tokenizer_init": (_OFF, "a model's tokenizer is always loaded"),
    "cpu_offload_gb": (_OFF, "weights are never offloaded to the host"),
    "hf_overrides": (_OFF, "the model's config.json is read as it is"),
    "limit_mm_per_prompt": (_OFF, "text-only models"),
    "mm_processor_kwargs": (_OFF, "text-only models"),
    "download_dir": (_OFF, "Hub downloads go to huggingface_hub's cache (set HF_HUB_CACHE)"),
    "override_generation_config": (_OFF, "use generation_config='vllm' and SamplingParams"),
}


def drop_vllm_no_ops(settings: dict) -> dict:
    """`settings` without vLLM's arguments that mean nothing here (each logged); ValueError for
    one whose value would silently mean something else (`VLLM_NO_OPS`)."""
    out = dict(settings)
    for name, (harmless, why) in VLLM_NO_OPS.items():
        if name not in out:
            continue
        value = out.pop(name)
        if not harmless(value):
            raise ValueError(f"{name}={value!r} is not supported: {why}")
        logger.info("%s=%r has no effect in jaxserve: %s", name, value, why)
    return out


# vLLM's name -> EngineConfig's, for options that mean the same thing
SETTING_ALIASES = {"max_num_seqs": "num_slots", "block_size": "page_size"}
# vLLM's dtype names -> jaxserve's. jaxserve computes in bfloat16 or float32; vLLM's "auto" keeps
# a 16-bit checkpoint's dtype and downcasts float32 to the platform's preferred 16-bit dtype
# (`_resolve_auto_dtype`), falling back to it for an unsupported float16: bfloat16 here.
DTYPE_ALIASES = {
    "auto": "bfloat16",
    "float": "float32",
    "float32": "float32",
    "bfloat16": "bfloat16",
    "float16": "bfloat16",
    "half": "bfloat16",
}
GENERATION_CONFIGS = ("auto", "vllm")
# generation_config.json fields vLLM takes as default sampling parameters (get_diff_sampling_param)
_GENERATION_FIELDS = (
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "max_new_tokens",
)


def vllm_settings(settings: dict) -> tuple[dict, VllmOptions]:
    """LLM()'s keyword arguments with vLLM's spellings mapped to EngineConfig's fields
    (max_num_seqs -> num_slots, block_size -> page_size, dtype="auto"/"half"/"float16"/"float",
    speculative_config -> its fields), and the vLLM options that are not EngineConfig fields.
    ValueError naming a bad one."""
    settings = drop_vllm_no_ops(settings)
    spec = settings.pop("speculative_config", None)
    settings = merge_speculative_config(settings, spec, "as a setting and in speculative_config")
    for alias, name in SETTING_ALIASES.items():
        if alias in settings:
            if name in settings:
                raise ValueError(f"{alias} is vLLM's name for {name}: pass one of them, not both")
            settings[name] = settings.pop(alias)
    dtype = settings.get("dtype")
    if isinstance(dtype, str) and dtype in DTYPE_ALIASES:
        if dtype in ("float16", "half"):
            logger.warning("dtype=%r: jaxserve has no float16 path; using bfloat16", dtype)
        settings["dtype"] = DTYPE_ALIASES[dtype]
    util = settings.pop("gpu_memory_utilization", None)
    if util is not None and (
        isinstance(util, bool) or not isinstance(util, int | float) or not 0 < util <= 1
    ):
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util!r}")
    if util is not None and settings.get("kv_cache_memory") is not None:
        raise ValueError("gpu_memory_utilization and kv_cache_memory both size the KV cache")
    tokenizer = settings.pop("tokenizer", None)
    if tokenizer is not None and not isinstance(tokenizer, str | os.PathLike):
        raise ValueError(f"tokenizer must be a path, got {type(tokenizer).__name__}")
    gen = settings.pop("generation_config", "auto")
    if gen not in GENERATION_CONFIGS:
        raise ValueError(f"generation_config must be one of {GENERATION_CONFIGS}, got {gen!r}")
    token = settings.pop("hf_token", None)
    if token is not None and not isinstance(token, str | bool):
        raise ValueError(f"hf_token must be a str or a bool, got {type(token).__name__}")
    return settings, VllmOptions(
        None if util is None else float(util),
        None if tokenizer is None else os.fspath(tokenizer),
        gen,
        token,
    )


def generation_defaults(model, generation_config: str) -> dict:
    """vLLM's default sampling parameters from `<model dir>/generation_config.json`: the values
    that differ from transformers' defaults (GenerationConfig.to_diff_dict) among vLLM's fields,
    max_new_tokens as max_tokens; `eos_token_ids` (a key for LLM) from its eos_token_id. {} for
    generation_config="vllm", a model without the file, or one without such values."""
    if generation_config == "vllm" or not isinstance(model, str):
        return {}
    path = os.path.join(model, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    from transformers import GenerationConfig  # lazy, as the loaders

    try:
        diff = GenerationConfig.from_pretrained(model, local_files_only=True).to_diff_dict()
    except (OSError, ValueError) as e:
        raise ValueError(f"generation_config: cannot read {path}: {e}") from e
    out = {p: diff[p] for p in _GENERATION_FIELDS if diff.get(p) is not None}
    if "max_new_tokens" in out:
        out["max_tokens"] = out.pop("max_new_tokens")
    if out:
        logger.warning(
            "default sampling parameters come from the model's generation_config.json: %s "
            "(generation_config='vllm' ignores them)",
            out,
        )
    eos = diff.get("eos_token_id")
    if eos is not None:
        out["eos_token_ids"] = (eos,) if isinstance(eos, int) else tuple(eos)
    return out


def kv_budget_bytes(utilization: float, device_bytes: int, param_bytes: int, state_bytes: int):
    """vLLM's KV budget: the fraction `utilization` of device memory, less the params and the
    slot state. ValueError naming gpu_memory_utilization when nothing is left."""
    budget = int(utilization * device_bytes) - param_bytes - state_bytes
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization} leaves no KV cache memory: "
            f"{utilization} x {device_bytes} bytes hold the params ({param_bytes}) and slot "
            f"state ({state_bytes}) only"
        )
    return budget


def apply_memory_utilization(engine_config: EngineConfig, config, params, utilization: float):
    """kv_cache_memory from gpu_memory_utilization on an accelerator (`engine_config` filled for
    the model). On the CPU vLLM sizes the KV cache by VLLM_CPU_KVCACHE_SPACE instead and ignores
    it; so does jaxserve (the default num_pages apply)."""
    import jax

    from jaxserve.runner.memory import device_memory_bytes, per_device, state_bytes

    if jax.local_devices()[0].platform == "cpu" or engine_config.cache.num_pages is not None:
        logger.info("gpu_memory_utilization ignored (CPU, or num_pages given)")
        return engine_config
    from jaxserve.runner.memory import bytes_on_device

    # per device: the params are already on their shards; the pool is split over every device
    parallel = engine_config.parallel
    devices = parallel.tensor_parallel_size * parallel.data_parallel_size
    param_bytes = bytes_on_device(params, jax.local_devices()[0])
    slot_state = per_device(state_bytes(config, engine_config, 0), engine_config)["slot_state"]
    budget = kv_budget_bytes(utilization, device_memory_bytes(), param_bytes, slot_state)
    return dataclasses.replace(engine_config, kv_cache_memory=budget * devices)


def mesh_settings(mesh, settings: dict) -> dict:
    """`settings` with the parallel sizes of a user's mesh (ValueError if they disagree)."""
    from jaxserve.parallel.mesh import mesh_sizes

    d, t = mesh_sizes(mesh)
    for name, size in (("data_parallel_size", d), ("tensor_parallel_size", t)):
        if settings.get(name, size) != size:
            raise ValueError(f"{name}={settings[name]} disagrees with the mesh's {size}")
    return {**settings, "data_parallel_size": d, "tensor_parallel_size": t}
