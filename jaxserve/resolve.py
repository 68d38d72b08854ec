"""Every backend-dependent choice, made once, on the host, when an engine is built.

    resolve(engine_config, model_config, backend) -> Resolved

`backend` is `jax.default_backend()` read ONCE by whoever builds the engine (or "gpu" in a test
that lowers a GPU engine's steps on this CPU). Nothing below it asks the backend again: layers and
kernels get their implementation as static arguments (`ModelImpl`), and the runner and scheduler
get their shape buckets from here. The choices:

    attention      auto -> on GPU the GPU kernel table's choice for the chip (below: today
                   'pallas', the Triton kernels, on every chip), 'reference' (XLA's gather) for a
                   model they cannot tile (`gpu_choices.attention_misfit`); on CPU 'cpu_kernel'
                   (decode and prefill through the C++ kernel of `cpu_kernels/`, read in place
                   from the pool; JOURNAL.md 37, 39) when it built here, else 'ragged' (XLA decode
                   over the step's live pages, its cost following the live tokens; prefill
                   chunks through `pallas_kernels.attention.xla.prefill_attention`)
    dense matmul   auto -> 'cpu_kernel' on CPU for bf16 weights on one device when the C++ matmul
                   of `cpu_kernels/` built here with a loop in AUTO_CPU_MATMUL: it reads each
                   layer's weight in place, and takes every batch, decode and prefill alike (one
                   implementation, so a row's bits never depend on its batch; JOURNAL.md
                   sections 38, 40 and 41); 'xla' (XLA's dot) otherwise
    quant matmul   auto -> on GPU the GPU kernel table's kernel for the chip and the rows up to
                   which it runs, per op (today 'pallas', the Triton W4A16 kernel up to 16 rows
                   and W8A16 up to 64, on every chip); 'xla' elsewhere (`quant/impls.py`)
    weight layout  'out_in' on CPU: plain layer weights stored [L, out, in] (XLA's CPU GEMM is
                   1.17-1.42x faster on decode-sized batches; JOURNAL.md section 21); 'fused' on
                   GPU on one model shard (q/k/v and gate/up each one stack, plain or 8-bit:
                   4 GEMMs a layer instead of 7; JOURNAL.md 64b); else 'in_out'
    moe matmul     'tiled' on CPU (a loop over row tiles of the chosen experts: XLA's CPU
                   `ragged_dot` does E times the work; JOURNAL.md section 33); on GPU 'kernel'
                   for quantized experts with a kernel impl (the same tiles in one launch of the
                   INT4 / W8A16 kernel per weight, each expert read in place; JOURNAL.md 63a),
                   'ragged_dot' else
    min rows       4 on CPU: smaller matmuls are padded (a one-row bf16 dot converts the whole
                   weight to f32 there; JOURNAL.md section 17); 2 on GPU, where XLA rewrites a
                   one-row dot with an f32 result (the tied logits) as a multiply-reduce over
                   the whole weight converted to f32 (a 113 MB copy a step for SmolLM2's
                   table; JOURNAL.md 54)
    slot buckets   decode row buckets: on CPU 1, 4, then 8, 12, 16, 24, 32, 48, ... (the powers
                   of two from 8 and the halfway points between them) up to num_slots
                   (`cpu_slot_buckets`): a step's matmuls cost in proportion to its rows from
                   about 8 rows up, and a served run's last requests decode a few at a time
                   (JOURNAL.md 51a); one bucket of all slots elsewhere
    widths         page-table width buckets (powers of two of pages, capped at max_pages_per_seq)
    prefill rows   prefill row buckets (powers of two of chunks up to the step's chunk budget)
    chunk lengths  prefill chunk length buckets T: on CPU max(page_size, chunk / 4) and the
                   chunk (prefill_chunk_size), so that a step whose chunks are all short (a prompt
                   tail after a prefix-cache hit, a short prompt) pays for 16 tokens a row, not
                   64 (a 1-row chunk: 22 vs 57 ms for SmolLM2 on a Zen 4 VM, JOURNAL.md 50a);
                   the chunk alone elsewhere. Prompt log-prob programs take the chunk only.
    XLA options    on GPU (`gpu_choices.gpu_compiler_options`): CUDA graphs that hold while
                   loops and conditionals; for float weights cuBLAS GEMMs reading each layer in
                   place and no dot merging (JOURNAL.md 54); none on CPU
    flat buckets   'ragged' decode: live-page buckets per slot bucket (powers of two from 8)
                   ('cpu_kernel': one decode program per slot bucket and one prefill program per
                   row bucket, over the whole page table, since the kernel's cost follows each
                   row's own pages whatever the table's width)

The GPU kernel table (`config/gpu_kernel_choices.toml`, checked by `config/gpu_choices.py`) holds
the GPU's choices as data, per chip (h100, h200, 'default') and bucket of rows, each row with its
source; `python -m jaxserve.bench.kernel_choices OUT_DIR` proposes a new one from a GPU run (BUILD.md
"Benchmarks"). An explicit setting wins over it (an explicit quantized kernel: its default rows).

Host only: no jax import (tests/core/test_host_only.py imports core/, which imports this).
"""

from __future__ import annotations

import dataclasses

from jaxserve.config import MAX_LOGPROBS, EngineConfig, ModelConfig, SpeculativeConfig, gpu_choices


@dataclasses.dataclass(frozen=True)
class ModelImpl:
    """What a traced model needs to know of the backend (hashable: a static jit argument)."""

    # 'pallas' | 'pallas_interpret' | 'mgpu' | 'mgpu_interpret' | 'ragged' | 'cpu_kernel' |
    # 'reference'
    attention: str = "reference"
    min_matmul_rows: int = 1  # plain matmuls of fewer rows are padded up to this
    moe_matmul: str = "ragged_dot"  # 'ragged_dot' | 'tiled' | 'kernel': `layers/moe.py`'s paths
    # plain bf16 matmuls run through the C++ CPU matmul (every batch size)
    cpu_matmul: bool = False


REFERENCE_IMPL = ModelImpl()  # the jnp reference attention, no padding: the default of the model


@dataclasses.dataclass(frozen=True)
class DecodeShape:
    """The static shape of one decode program (`runner.steps.generate`)."""

    rows: int  # slot row bucket: the step computes slots [0, rows)
    width: int  # page-table width (pages visible per row)
    num_flat: int  # 'ragged' attention's live-page bucket (0 for the other implementations)
    num_top: int = MAX_LOGPROBS  # top log-probs per token (the engine's max_logprobs)


@dataclasses.dataclass(frozen=True)
class PrefillShape:
    """The static shape of one prefill program (`runner.steps.prefill`)."""

    rows: int  # chunk rows R of the [R, T] batch
    chunk: int  # tokens per row T (a bucket of Resolved.chunks)
    width: int  # page-table width
    prompt_logprobs: bool  # the variant that also scores every prompt token
    num_top: int = MAX_LOGPROBS  # top log-probs per token (the engine's max_logprobs)


def weight_layout(backend: str, tensor_parallel_size: int) -> str:
    """How the runner stores the layer weights (`runner/device_state.kernel_layout`). CPU: 'out_in'
    (PyTorch's [out, in]: XLA's CPU GEMM and the C++ matmul read it faster). GPU, one model shard:
    'fused', q/k/v and gate/up each concatenated into one stack where they are plain or 8-bit
    per-channel (`linear.fuse_projections`), so a layer runs 4 GEMMs or W8A16 launches instead
    of 7 (Llama-3-8B decode: 20 kernels a layer against 23 in bf16, 23 against 26 in INT8;
    JOURNAL.md 64b). Else 'in_out', as loaded (a column-split fused stack would need each
    shard's q/k/v side by side)."""
    if backend == "cpu":
        return "out_in"
    return "fused" if backend == "gpu" and tensor_parallel_size == 1 else "in_out"


def pow2_buckets(limit: int, start: int = 1) -> tuple[int, ...]:
    """start, 2 * start, 4 * start, ... below `limit`, then `limit` itself."""
    out, b = [], start
    while b < limit:
        out.append(b)
        b *= 2
    return (*out, limit)


def cpu_slot_buckets(num_slots: int) -> tuple[int, ...]:
    """The CPU's decode row buckets: 1, 4, then 8, 12, 16, 24, 32, 48, 64, ... (each power of two
    from 8 and 1.5 times it) below num_slots, then num_slots itself."""
    out, b = [1, 4], 8
    while b < num_slots:
        out += [b, b * 3 // 2]
        b *= 2
    return (*(x for x in out if x < num_slots), num_slots)


def moe_matmul(cpu: bool, plain_weights: bool, quant_matmul: str) -> str:
    """The mixture of experts' grouped path (`layers/moe.py`): 'tiled' on CPU; on GPU 'kernel'
    for quantized experts whose matmul is a kernel (one tiled launch per weight, each expert read
    in place), else 'ragged_dot'."""
    if cpu:
        return "tiled"
    return "ragged_dot" if plain_weights or quant_matmul in ("xla", "reference") else "kernel"


def data_shard_config(engine_config: EngineConfig) -> EngineConfig:
    """One data shard's config, whose slots the step programs hold: num_slots / D, data parallel
    1, the decode row buckets over its slots (each user bucket / D). The config itself at D 1."""
    d = engine_config.parallel.data_parallel_size
    if d == 1:
        return engine_config
    buckets = engine_config.scheduler.slot_buckets
    if buckets != "auto":
        buckets = tuple(sorted({max(1, b // d) for b in buckets}))
    return dataclasses.replace(
        engine_config,
        num_slots=engine_config.scheduler.num_slots // d,
        data_parallel_size=1,
        slot_buckets=buckets,
    )


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest of `buckets` (increasing) that is >= n (the largest if none is)."""
    return next((b for b in buckets if b >= n), buckets[-1])


@dataclasses.dataclass(frozen=True)
class Resolved:
    """The engine's backend-dependent choices and shape buckets (see the module docstring)."""

    backend: str
    model: ModelImpl
    quant_matmul: str  # the quantized weights' matmul impl (`quant/impls.py`)
    weight_layout: str  # 'in_out' | 'out_in' (CPU) | 'fused' (GPU: `weight_layout`)
    slot_buckets: tuple[int, ...]  # decode row buckets, increasing, the last = num_slots
    widths: tuple[int, ...]  # page-table width buckets, the last = max_pages_per_seq
    prefill_rows: tuple[int, ...]  # prefill row buckets, the last = the step's chunk budget
    max_flat: int  # most page references a decode step can list ('ragged'; 0 otherwise)
    max_pages: int  # max_pages_per_seq
    chunks: tuple[int, ...]  # prefill chunk length buckets T, increasing, the last = the chunk
    num_top: int = MAX_LOGPROBS  # top log-probs per token: max_logprobs (-1: the vocabulary)
    # XLA options every step program is compiled with ((name, value) pairs; none on CPU)
    compiler_options: tuple[tuple[str, str], ...] = ()
    # ((op, rows), ...): the rows up to which quant_matmul's kernel runs per GPU-table matmul op
    # (`quant.with_matmul_impl`); () leaves the weights' defaults (an explicit impl, the CPU)
    quant_kernel_rows: tuple[tuple[str, int], ...] = ()

    @property
    def chunk(self) -> int:
        """The prefill chunk length (prefill_chunk_size): the most tokens a chunk holds."""
        return self.chunks[-1]

    @property
    def ragged(self) -> bool:
        return self.model.attention == "ragged"

    def width_for(self, num_pages: int) -> int:
        """The smallest width bucket holding `num_pages` pages."""
        if num_pages > self.max_pages:
            raise ValueError(f"{num_pages} pages exceed max_pages_per_seq={self.max_pages}")
        return bucket_for(num_pages, self.widths)

    def flat_buckets(self, rows: int) -> tuple[int, ...]:
        """The live-page buckets of a 'ragged' decode step over `rows` slots."""
        return pow2_buckets(min(self.max_flat, rows * self.max_pages), start=8)

    def decode_shape(self, max_slot: int, pages: list[int], live: int | None = None) -> DecodeShape:
        """The decode program for rows whose highest slot is `max_slot`, holding `pages` pages.
        `live`: the most pages one data shard's rows hold (default: all of `pages`, one shard);
        each shard's program lists its own rows' pages."""
        rows = bucket_for(max_slot + 1, self.slot_buckets)
        if self.ragged:
            live = sum(pages) if live is None else live
            flat = self.flat_buckets(rows)
            if live > flat[-1]:  # cannot happen: each row holds at most max_pages
                raise ValueError(f"{live} live pages exceed the step's {flat[-1]}")
            return DecodeShape(rows, self.max_pages, bucket_for(live, flat), self.num_top)
        if self.model.attention == "cpu_kernel":
            self.width_for(max(pages))  # checks max_pages_per_seq
            return DecodeShape(rows, self.max_pages, 0, self.num_top)
        return DecodeShape(rows, self.width_for(max(pages)), 0, self.num_top)

    @property
    def prompt_logprob_rows(self) -> tuple[int, ...]:
        """The row buckets with a prompt log-prob program: one row (a lone request, as
        lm-evaluation-harness sends by default, runs no padding rows through the model) and
        the full count, so the extra programs are one more per width, not one per row bucket."""
        return tuple(sorted({self.prefill_rows[0], self.prefill_rows[-1]}))

    def prefill_shape(
        self, num_chunks: int, longest: int, num_pages: int, prompt_logprobs: bool
    ) -> PrefillShape:
        """The prefill program for `num_chunks` chunks, the longest of `longest` tokens, whose
        longest sequence holds `num_pages` pages (with prompt log-probs: among
        `prompt_logprob_rows`, and the full chunk length)."""
        buckets = self.prompt_logprob_rows if prompt_logprobs else self.prefill_rows
        rows = bucket_for(num_chunks, buckets)
        if longest > self.chunk:
            raise ValueError(f"a chunk of {longest} tokens exceeds the chunk length {self.chunk}")
        chunk = self.chunk if prompt_logprobs else bucket_for(longest, self.chunks)
        width = self.width_for(num_pages)  # checks max_pages_per_seq
        if self.model.attention == "cpu_kernel":
            width = self.max_pages
        return PrefillShape(rows, chunk, width, prompt_logprobs, self.num_top)

    def decode_shapes(self) -> list[DecodeShape]:
        """Every shape `decode_shape` can return."""
        if self.ragged:
            return [
                DecodeShape(b, self.max_pages, f, self.num_top)
                for b in self.slot_buckets
                for f in self.flat_buckets(b)
            ]
        if self.model.attention == "cpu_kernel":
            return [DecodeShape(b, self.max_pages, 0, self.num_top) for b in self.slot_buckets]
        return [DecodeShape(b, w, 0, self.num_top) for b in self.slot_buckets for w in self.widths]

    def speculative_shapes(self, speculative: SpeculativeConfig) -> list[tuple[DecodeShape, int]]:
        """The (decode shape, drafts a row) pairs a speculative step may run: the scheduler picks
        the drafts by the number of requests holding a slot (`SpeculativeConfig.draft_tokens`),
        and the step runs over the row bucket of its decoding rows, at most that number's bucket.
        None without speculation (`speculative`: the config's this was resolved from)."""
        if not speculative.num_speculative_tokens:
            return []
        held = range(1, self.slot_buckets[-1] + 1)  # the last bucket is num_slots
        drafts = speculative.draft_tokens
        return [
            (s, k)
            for s in self.decode_shapes()
            for k in sorted(
                {drafts(n) for n in held if bucket_for(n, self.slot_buckets) >= s.rows} - {0},
                reverse=True,
            )
        ]

    def prefill_shapes(self) -> list[PrefillShape]:
        """Every shape `prefill_shape` can return."""
        out = []
        widths = [self.max_pages] if self.model.attention == "cpu_kernel" else self.widths
        for w in widths:
            for t in self.chunks:
                out += [PrefillShape(r, t, w, False, self.num_top) for r in self.prefill_rows]
            out += [
                PrefillShape(r, self.chunk, w, True, self.num_top) for r in self.prompt_logprob_rows
            ]
        return out


# The C++ matmul's loops that 'auto' takes (`cpu_kernels.matmul.path()`): both beat XLA's dot
# on a SmolLM2 decode step and prefill chunk (sections 38 and 41). Not the portable loop. When
# chosen it takes every batch: a kernel for decode batches beside XLA's dot for prefill batches
# gave a row other bits (at bf16 rounding) alone than in a batch (section 40e). An explicit
# 'cpu_kernel' takes any loop.
AUTO_CPU_MATMUL = ("avx512bf16", "avx2")


def resolve(
    engine_config: EngineConfig,
    model_config: ModelConfig,
    backend: str,
    cpu_kernel: bool = False,
    cpu_matmul: str | None = None,
    plain_weights: bool = True,
    autotune_cache_dir: str | None = None,
    device_kind: str | None = None,
) -> Resolved:
    """The engine's choices on `backend` ('cpu', 'gpu', ...), from its filled EngineConfig.

    cpu_kernel: whether the C++ CPU attention kernel built and registered in this process
    (`cpu_kernels.paged_decode_attention.available()`, which the runner asks: this module imports
    no jax). It decides what attention_impl='auto' means on CPU.
    cpu_matmul: the loop the C++ CPU matmul runs here ('avx512bf16', 'avx2', 'portable';
    `cpu_kernels.matmul.path()`) when it can run for this engine (the runner asks: built here, on
    one device), else None.
    plain_weights: whether every layer weight is a float array (none quantized; the runner looks
    at the params): it picks the GPU's GEMMs (`gpu_choices.gpu_compiler_options`);
    autotune_cache_dir: the GPU's autotuning cache (`runner/compile_cache.autotune_dir`).
    device_kind: the GPU's (`jax.Device.device_kind`, e.g. "NVIDIA H200"), whose row of the GPU
    kernel table 'auto' takes on GPU (None: the table's default row)."""
    c, m = engine_config, model_config
    if not c.is_filled:
        raise ValueError("resolve needs a filled EngineConfig: call for_model(model_config) first")
    kernels, sched, dtype = c.kernels, c.scheduler, c.load.dtype
    cpu = backend == "cpu"
    table = gpu_choices.for_device(device_kind) if backend == "gpu" else None
    attention = kernels.attention_impl
    if attention == "auto" and table is not None:  # the table's kernels, where they run the model
        misfit = gpu_choices.attention_misfit(table.attention, m.head_dim)
        attention = "reference" if misfit else table.attention
    elif attention == "auto":
        attention = "cpu_kernel" if cpu and cpu_kernel else "ragged"
    elif why := gpu_choices.attention_misfit(attention, m.head_dim):
        raise ValueError(f"attention_impl={attention!r}: {why}; 'reference' runs any model")
    if attention == "cpu_kernel" and not (cpu and cpu_kernel):
        raise ValueError(
            f"attention_impl='cpu_kernel' needs the CPU backend and the built C++ kernel "
            f"(backend {backend!r}, kernel built: {cpu_kernel})"
        )
    matmul = kernels.matmul_impl
    if matmul == "auto":
        fast = cpu_matmul in AUTO_CPU_MATMUL
        matmul = "cpu_kernel" if cpu and fast and dtype == "bfloat16" else "xla"
    if matmul == "cpu_kernel" and not (cpu and cpu_matmul and dtype == "bfloat16"):
        raise ValueError(
            f"matmul_impl='cpu_kernel' needs the CPU backend, the built C++ matmul, one device "
            f"and bfloat16 weights (backend {backend!r}, kernel path: {cpu_matmul}, "
            f"dtype {dtype})"
        )
    quant_matmul, kernel_rows = kernels.quant_matmul_impl, ()
    if quant_matmul == "auto" and table is not None:
        quant_matmul, kernel_rows = table.quant_matmul, table.kernel_rows
    elif quant_matmul == "auto":
        quant_matmul = "xla"
    if sched.slot_buckets == "auto":
        slot_buckets = cpu_slot_buckets(sched.num_slots) if cpu else (sched.num_slots,)
    else:
        slot_buckets = tuple(sched.slot_buckets)
    max_pages = c.max_pages_per_seq
    chunk = sched.prefill_chunk_size
    short = max(c.cache.page_size, chunk // 4)
    chunks = (short, chunk) if cpu and short < chunk else None
    top = c.requests.max_logprobs
    return Resolved(
        backend=backend,
        model=ModelImpl(
            attention=attention,
            min_matmul_rows=4 if cpu else 2,
            moe_matmul=moe_matmul(cpu, plain_weights, quant_matmul),
            cpu_matmul=matmul == "cpu_kernel",
        ),
        quant_matmul=quant_matmul,
        weight_layout=weight_layout(backend, c.parallel.tensor_parallel_size),
        slot_buckets=slot_buckets,
        widths=pow2_buckets(max_pages),
        prefill_rows=pow2_buckets(sched.max_prefill_rows),
        # Not capped by the pool: a page shared through the prefix cache is listed once per
        # request reading it, so a step can list more pages than the pool holds.
        max_flat=sched.num_slots * max_pages if attention == "ragged" else 0,
        max_pages=max_pages,
        chunks=chunks or (chunk,),
        num_top=m.vocab_size if top == -1 else min(top, m.vocab_size),
        compiler_options=(
            gpu_choices.gpu_compiler_options(plain_weights, autotune_cache_dir)
            if backend == "gpu"
            else ()
        ),
        quant_kernel_rows=kernel_rows,
    )
