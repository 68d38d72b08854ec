"""`EngineConfig`: every engine setting once (settings.py), the rules between settings,
`for_model`, which fills the defaults that depend on the model, and the settings in groups.

What to load, slots, pages, dtypes, chunk sizes, which attention implementation runs, speculation,
LoRA, parallelism. `LLM(model, **settings)` takes exactly its fields and the launch flags are
generated from them. Defaults that depend on the model (max_model_len, the prefill chunk and the
step's token budget) stay None until `EngineConfig.for_model(model_config)` fills them; the
engine's parts take only filled configs. Each field declares its check beside its default;
`__post_init__` runs them, then the rules between fields, raising `ValueError` naming the field.

The flat settings are the user's surface (vLLM's EngineArgs); the engine's parts read them in
groups (groups.py, vLLM's VllmConfig): `config.load`, `.cache`, `.scheduler`, `.parallel`,
`.speculative`, `.lora`, `.kernels`, `.compilation`, `.requests`, each a frozen dataclass built
once from the filled config. A part takes the group it reads (`Scheduler(config.scheduler,
config.cache, ...)`), or, reading several, the config and each through its group
(`config.scheduler.num_slots`); no module of core/ or runner/ reads a flat field
(tests/test_architecture.py).
"""

from __future__ import annotations

import dataclasses
import functools

from jaxserve.config import groups
from jaxserve.config.model import ModelConfig
from jaxserve.config.settings import EngineSettings
from jaxserve.config.speculative import checked_fields

DEFAULT_MAX_MODEL_LEN = 2048  # max_model_len None -> min(max_position_embeddings, this)
DEFAULT_PREFILL_CHUNK_SIZE = 64  # capped at the smallest power of two >= max_model_len
DEFAULT_PREFILL_CHUNKS_PER_STEP = 8  # max_num_batched_tokens None -> this * prefill_chunk_size


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig(EngineSettings):
    """Every setting of an engine, each with its default and help text, fixed for its lifetime.

    `LLM(model, **settings)` takes exactly these fields and the launch flags are generated from
    them (`jaxserve/launch/flags.py`), so a setting and its default live in settings.py only. A
    config is built in two steps:

        EngineConfig(model=..., num_slots=..., ...)   what the user said; checked on its own
          .for_model(model_config)                     the filled config: model-dependent defaults
                                                       (None below) computed, checked against the
                                                       model; the engine's parts take only this

    The defaults left None until `for_model`: max_model_len (min of the model's
    max_position_embeddings and 2048), prefill_chunk_size (64, capped at the smallest power of two
    >= max_model_len) and max_num_batched_tokens (8 chunks). Change fields with
    `dataclasses.replace` on the unfilled config, then fill it: a filled config keeps the values
    derived from its old max_model_len. Bad values raise ValueError naming the field.

    The engine's parts read the settings in groups (groups.py): `config.cache`,
    `config.scheduler` (filled configs only), `config.parallel`, ..., each built once.
    """

    def __post_init__(self):
        super().__post_init__()  # a path as a str; each field's own check
        # The rules between fields.
        if isinstance(self.model, ModelConfig) and self.load_format != "dummy":
            raise ValueError(
                "EngineConfig.model is a ModelConfig, which has no weights to read: it needs "
                f"load_format='dummy', got load_format={self.load_format!r}"
            )
        if self.num_slots % self.data_parallel_size:
            raise ValueError(
                f"EngineConfig.num_slots ({self.num_slots}) must be a multiple of "
                f"data_parallel_size ({self.data_parallel_size}): each replica owns an equal share"
            )
        if self.enable_lora and self.data_parallel_size > 1:
            raise ValueError(
                "EngineConfig.enable_lora needs data_parallel_size=1 (adapters are not yet "
                "shared across data-parallel replicas)"
            )
        for name, value in checked_fields(self).items():
            object.__setattr__(self, name, value)
        if self.num_speculative_tokens and (self.decode_steps > 1 or self.data_parallel_size > 1):
            raise ValueError(
                "EngineConfig.num_speculative_tokens needs decode_steps=1 and "
                f"data_parallel_size=1, got decode_steps={self.decode_steps}, "
                f"data_parallel_size={self.data_parallel_size}"
            )
        if self.slot_buckets != "auto":
            b = self.slot_buckets
            if (
                not isinstance(b, (tuple, list))
                or not b
                or any(not isinstance(x, int) or isinstance(x, bool) or x < 1 for x in b)
                or list(b) != sorted(set(b))
                or b[-1] != self.num_slots
            ):
                raise ValueError(
                    "EngineConfig.slot_buckets must be 'auto' or increasing positive ints ending "
                    f"at num_slots={self.num_slots}, got {b!r}"
                )
            object.__setattr__(self, "slot_buckets", tuple(b))

    def for_model(self, model_config: ModelConfig) -> EngineConfig:
        """This config with every model-dependent default filled in, checked against the model.

            max_model_len None          -> min(model_config.max_position_embeddings, 2048)
            prefill_chunk_size None     -> min(64, smallest power of two >= max_model_len)
            max_num_batched_tokens None -> 8 * prefill_chunk_size

        Values already set are kept, so a filled config comes back equal. ValueError if
        max_model_len exceeds the model's max_position_embeddings.
        """
        max_pos = model_config.max_position_embeddings
        max_model_len = self.max_model_len
        if max_model_len is None:
            max_model_len = min(max_pos, DEFAULT_MAX_MODEL_LEN)
        if max_model_len > max_pos:
            raise ValueError(
                f"EngineConfig.max_model_len={max_model_len} exceeds the model's "
                f"max_position_embeddings={max_pos}"
            )
        longest = 1 << (max_model_len - 1).bit_length()  # smallest power of two >= max_model_len
        if self.page_size > longest:
            raise ValueError(
                f"EngineConfig.page_size={self.page_size} is larger than a whole sequence "
                f"(max_model_len={max_model_len}): every sequence would hold one page of which "
                f"at most {max_model_len} tokens are used; use page_size <= {longest}"
            )
        chunk = self.prefill_chunk_size
        if chunk is None:
            chunk = min(DEFAULT_PREFILL_CHUNK_SIZE, longest)
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = DEFAULT_PREFILL_CHUNKS_PER_STEP * chunk
        return dataclasses.replace(
            self,
            max_model_len=max_model_len,
            prefill_chunk_size=chunk,
            max_num_batched_tokens=budget,
        )

    @property
    def is_filled(self) -> bool:
        """Whether `for_model` has filled the model-dependent defaults (what the engine needs)."""
        return all(getattr(self, name) is not None for name in groups.FILLED_BY_MODEL)

    @property
    def max_pages_per_seq(self) -> int:
        """Pages of one sequence at max_model_len (the page table's width); needs a filled config."""
        if self.max_model_len is None:
            raise ValueError(
                "EngineConfig.max_model_len is None: fill the model-dependent defaults with "
                "for_model(model_config) first"
            )
        return -(-self.max_model_len // self.page_size)

    # -- the settings in groups (groups.py), each built once, on first use ----------------------
    @functools.cached_property
    def load(self) -> groups.LoadConfig:
        """What to load and as what (`LoadConfig`)."""
        return groups.build(self, "load")

    @functools.cached_property
    def cache(self) -> groups.CacheConfig:
        """The paged KV cache (`CacheConfig`)."""
        return groups.build(self, "cache")

    @functools.cached_property
    def scheduler(self) -> groups.SchedulerConfig:
        """How requests share slots and steps (`SchedulerConfig`); ValueError before `for_model`."""
        return groups.build(self, "scheduler")

    @functools.cached_property
    def parallel(self) -> groups.ParallelConfig:
        """The device mesh's sizes (`ParallelConfig`)."""
        return groups.build(self, "parallel")

    @functools.cached_property
    def speculative(self) -> groups.SpeculativeConfig:
        """Prompt-lookup speculative decoding (`SpeculativeConfig`, its `draft_tokens`)."""
        return groups.build(self, "speculative")

    @functools.cached_property
    def lora(self) -> groups.LoRAConfig:
        """Multi-LoRA serving (`LoRAConfig`)."""
        return groups.build(self, "lora")

    @functools.cached_property
    def kernels(self) -> groups.KernelConfig:
        """The implementations asked for, before `resolve` decides 'auto' (`KernelConfig`)."""
        return groups.build(self, "kernels")

    @functools.cached_property
    def compilation(self) -> groups.CompilationConfig:
        """The persistent compilation cache and the warm-up (`CompilationConfig`)."""
        return groups.build(self, "compilation")

    @functools.cached_property
    def requests(self) -> groups.RequestConfig:
        """What a request may ask and what becomes of it (`RequestConfig`)."""
        return groups.build(self, "requests")
