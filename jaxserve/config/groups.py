"""The engine's settings in groups, one frozen dataclass per concern, each holding the settings
its parts read (vLLM's VllmConfig: model_config, cache_config, scheduler_config, ...).

    flat settings (settings.py; vLLM's EngineArgs spellings: LLM(model, **settings), the launch
    flags, the server)
      -> EngineConfig, checked; .for_model(model_config) fills the model's defaults once
      -> config.load, config.cache, config.scheduler, ...: these groups, built from it
      -> the engine's parts, each given the group(s) it reads

A setting names its group beside its default (`setting(..., group="cache")`). Each class below
is made (`_group`) a frozen, keyword-only dataclass of exactly the settings naming its group, in
settings.py's order, with their defaults and help text, so a new setting is still written in one
place; its methods are rules over its own settings only. A group is not checked again: it is
built from a checked `EngineConfig`.

    group        class              read by
    load         LoadConfig         build_engine (what to load); its dtype also sizes the KV pool
                                    (memory.py, device_state.py) and gates the C++ CPU matmul
    cache        CacheConfig        the KV pool (memory.py, device_state.py), the scheduler's pages
    scheduler    SchedulerConfig    Scheduler, LLMEngine, RequestChecker, resolve's buckets; only
                                    from a filled config (its model-dependent defaults set)
    parallel     ParallelConfig     the mesh, the runner's data shards, make_scheduler
    speculative  SpeculativeConfig  Scheduler.speculates, SpeculativeDecoding, resolve's shapes
    lora         LoRAConfig         LLMEngine's adapter slots, runner/lora_stacks.py
    kernels      KernelConfig       runner/cpu_backend.py and resolve: which implementations run
    compilation  CompilationConfig  the persistent compilation cache and the build's warm-up
    requests     RequestConfig      what a request may ask and what becomes of it: its log-probs
                                    (RequestChecker, resolve's top-k), its seed when it brings
                                    none (LLMEngine), a bad one's fate (LLM)

Two groups differ from vLLM's. seed, max_logprobs and on_bad_request form `RequestConfig`, not
parts of a model or scheduler config: no scheduler or model code reads them, only the engine's
front (request checks, seeding, the LLM's error policy) and the device's top-k size. And the
compilation cache and warm-up form `CompilationConfig` (vLLM's compilation_config is the nearest):
the runner reads the one, build_engine the other, nothing else either.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.config.settings import EngineSettings
from jaxserve.config.speculative import schedule_drafts

# The settings for_model fills (None until then): a SchedulerConfig needs them set.
FILLED_BY_MODEL = ("max_model_len", "prefill_chunk_size", "max_num_batched_tokens")

GROUPS: dict[str, type] = {}  # group name -> its class, in declaration order


def _group(name: str):
    """The decorated class as a frozen, keyword-only dataclass whose fields are the settings of
    group `name` (their defaults and help; the checks stay with EngineConfig)."""

    def make(cls: type) -> type:
        mine = [f for f in dataclasses.fields(EngineSettings) if f.metadata["group"] == name]
        cls.__annotations__ = {f.name: f.type for f in mine}
        for f in mine:
            help_text = {"help": f.metadata["help"]}
            setattr(cls, f.name, dataclasses.field(default=f.default, metadata=help_text))
        GROUPS[name] = dataclasses.dataclass(frozen=True, kw_only=True)(cls)
        return cls

    return make


def build(config: Any, name: str) -> Any:
    """Group `name` of `config` (an EngineConfig): its settings' values."""
    cls = GROUPS[name]
    return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})


@_group("load")
class LoadConfig:
    """What to load and as what: the model (path, Hub id, preset or ModelConfig), its revision,
    the weight format, load-time quantization, and the float dtype of weights and activations."""


@_group("cache")
class CacheConfig:
    """The paged KV cache: page size, pool size (pages or bytes), element dtype, and whether
    identical prompt prefixes share their pages (prefix caching)."""


@_group("scheduler")
class SchedulerConfig:
    """How requests share the engine's slots and steps: the slots, the longest sequence, the
    prefill chunk and a step's token budget, decode steps per round trip, batching, the
    admission policy, async scheduling, the decode row buckets. Built only from a filled config
    (`EngineConfig.for_model`): max_model_len, prefill_chunk_size and max_num_batched_tokens
    are ints here."""

    def __post_init__(self):
        unfilled = [n for n in FILLED_BY_MODEL if getattr(self, n) is None]
        if unfilled:
            raise ValueError(
                f"SchedulerConfig needs {', '.join(unfilled)} filled for the model: take it from "
                "engine_config.for_model(model_config).scheduler"
            )

    @property
    def max_prefill_rows(self) -> int:
        """Prompt chunks one step prefills at most: the token budget in chunks, at least one."""
        return max(1, self.max_num_batched_tokens // self.prefill_chunk_size)


@_group("parallel")
class ParallelConfig:
    """The device mesh: tensor-parallel shards of each replica, data-parallel replicas."""


@_group("speculative")
class SpeculativeConfig:
    """Prompt-lookup (n-gram) speculative decoding: the drafts a row proposes (0: off), the
    n-gram lengths matched, and the batch sizes at which fewer drafts, or none, are proposed."""

    def draft_tokens(self, batch_size: int) -> int:
        """Drafts a row proposes in a speculative step while `batch_size` requests hold a slot:
        num_speculative_tokens, or the schedule's k (num_speculative_tokens_per_batch_size); 0
        (decode plainly) past speculative_disable_by_batch_size."""
        cap = self.speculative_disable_by_batch_size
        if cap is not None and batch_size > cap:
            return 0
        return schedule_drafts(
            self.num_speculative_tokens_per_batch_size, self.num_speculative_tokens, batch_size
        )


@_group("lora")
class LoRAConfig:
    """Multi-LoRA serving: whether it is on, the adapters held on the device and on the host,
    and the largest rank served."""


@_group("kernels")
class KernelConfig:
    """The implementations asked for (attention, dense and quantized matmuls); 'auto' is
    decided per backend by `jaxserve.resolve`."""


@_group("compilation")
class CompilationConfig:
    """Compiled programs: the persistent compilation cache, and whether every step program is
    compiled while the engine is built (warm-up)."""


@_group("requests")
class RequestConfig:
    """What a request may ask and what becomes of it: the seed of the generator of seeds for
    requests without their own, the most log-probs a request may ask for, and what LLM does with
    a request that cannot run."""
