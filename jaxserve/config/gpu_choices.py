"""The GPU kernel table: what 'auto' picks on each GPU, as data (gpu_kernel_choices.toml here).

    load(path=None) -> tuple[Choice, ...]      the rows of the file, checked (default: the shipped)
    chip_of(device_kind, choices) -> str        "NVIDIA H100 80GB HBM3" -> "h100"; else "default"
    for_chip(chip, choices) -> ChipChoices      what the engine runs there (`jaxserve.resolve`)
    for_device(device_kind) -> ChipChoices      the two above on the shipped table
    to_toml(choices) -> str                     the file's text (`load` reads it back unchanged)
    attention_misfit(attention, head_dim)       why the attention kernels cannot run a model
    gpu_compiler_options(plain_weights, ...)    the XLA options of a GPU engine's programs

A row says: on GPU `chip`, operation `op` (over a bucket of rows, for the quantized matmuls) runs
`candidate`; `measured` says whether a GPU run timed the candidates there and chose this one
(`jaxserve.bench.kernel_choices` writes such rows from the prepared GPU run);
`source` names the run or the JOURNAL.md section behind it. The file's header says the format.

The engine can only run some tables, and `load` refuses the rest, naming the file and line: it runs
one attention implementation (decode and prefill kernels of one family: `ModelImpl.attention`), and
sets one matmul impl on every quantized weight (`quant.with_matmul_impl`), whose kernel serves the
rows up to a limit and XLA's path above it (`Int4Weight.kernel_rows`). So per chip: both attention
rows name one candidate; each matmul op's buckets cover 1 row and up without gap or overlap, a
kernel on the first ones and 'xla' on the rest (the open-ended last bucket: 'xla'); and the INT4
and W8 ops name the same kernel. Host only (no jax): `resolve` reads it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import tomllib
from pathlib import Path

SHIPPED = Path(__file__).with_name("gpu_kernel_choices.toml")
DEFAULT_CHIP = "default"  # the rows for a GPU no other chip name matches
ATTENTION_OPS = ("decode_attention", "prefill_attention")
MATMUL_OPS = ("int4_matmul", "w8_matmul")  # W8: the INT8 and FP8 weights' W8A16 kernels
KERNELS = ("pallas", "mgpu")  # the Triton and the Mosaic GPU kernels of each op
CANDIDATES = {
    **dict.fromkeys(ATTENTION_OPS, ("pallas", "mgpu", "ragged", "reference")),
    **dict.fromkeys(MATMUL_OPS, (*KERNELS, "xla")),
}
ROW_HEADER = re.compile(r"\s*\[\[\s*choice\s*\]\]")  # a row's first line
FIELDS = ("chip", "op", "min_rows", "max_rows", "candidate", "measured", "source")

HEADER = """\
# What attention_impl="auto" and quant_matmul_impl="auto" run on a GPU, per chip and shape bucket.
# Read and checked by jaxserve/config/gpu_choices.py; used by jaxserve/resolve.py. A GPU run
# proposes a new file (BUILD.md, "Benchmarks"): experiments/gpu_checks.sh kernels w8, then
#   python -m jaxserve.bench.kernel_choices OUT_DIR --out jaxserve/config/gpu_kernel_choices.toml
#
# chip       a word of the device kind, lower case ("NVIDIA H100 80GB HBM3" -> h100); "default":
#            every other GPU
# op         decode_attention, prefill_attention: one row each, the same candidate (the engine
#            runs one attention implementation): pallas (Triton), mgpu (Mosaic GPU), ragged,
#            reference (XLA);
#            int4_matmul, w8_matmul (INT8 and FP8 weights): buckets of rows [min_rows, max_rows]
#            (no max_rows: no bound) from 1 up, a kernel (pallas, mgpu) on the first buckets and
#            xla (unpack / convert + dot) on the rest; one kernel for both ops of a chip
# measured   true: a GPU run timed the candidates here and chose this one (the fastest whose
#            output was right, among the tables the engine can run)
# source     the run (device, date, commit) and how the candidates compared, or the JOURNAL.md
#            section the choice comes from
"""


@dataclasses.dataclass(frozen=True)
class Choice:
    """One row: on `chip`, `op` (over rows [min_rows, max_rows] for a matmul) runs `candidate`."""

    chip: str
    op: str
    candidate: str
    measured: bool
    source: str
    min_rows: int | None = None  # matmul ops only: the bucket's first row count
    max_rows: int | None = None  # its last (None: no bound)
    line: int = dataclasses.field(default=0, compare=False)  # where the row starts in its file

    def holds(self, rows: int) -> bool:
        return self.min_rows <= rows and (self.max_rows is None or rows <= self.max_rows)


@dataclasses.dataclass(frozen=True)
class ChipChoices:
    """What the engine runs on one chip: its attention, and the impl set on every quantized weight
    with the rows up to which that impl's kernel runs, per matmul op (0: XLA's path always)."""

    chip: str
    attention: str
    quant_matmul: str  # 'pallas' | 'mgpu' | 'xla' (no kernel for either op)
    kernel_rows: tuple[tuple[str, int], ...]  # ((op, rows), ...) for MATMUL_OPS


def chip_of(device_kind: str | None, choices: tuple[Choice, ...]) -> str:
    """The table's chip for a device kind: a chip name that is a word of it (case-insensitive),
    else DEFAULT_CHIP (also for None: a GPU engine lowered without a device)."""
    words = set(re.split(r"[^a-z0-9]+", (device_kind or "").lower()))
    named = sorted({c.chip for c in choices} - {DEFAULT_CHIP})
    return next((chip for chip in named if chip in words), DEFAULT_CHIP)


def for_chip(chip: str, choices: tuple[Choice, ...]) -> ChipChoices:
    """The engine's choices on `chip` (a chip of the table; `load` checked they can run)."""
    rows = [c for c in choices if c.chip == chip]
    if not rows:
        raise ValueError(f"the GPU kernel table has no rows for chip {chip!r}")
    attention = next(c.candidate for c in rows if c.op == ATTENTION_OPS[0])
    kernel, limits = "xla", []
    for op in MATMUL_OPS:
        on = [c for c in rows if c.op == op and c.candidate != "xla"]
        kernel = on[0].candidate if on else kernel
        limits.append((op, max((c.max_rows for c in on), default=0)))
    return ChipChoices(chip, attention, kernel, tuple(limits))


def for_device(device_kind: str | None, path: str | Path | None = None) -> ChipChoices:
    """`for_chip` of the device kind's chip in the table at `path` (default: the shipped one)."""
    choices = load(path)
    return for_chip(chip_of(device_kind, choices), choices)


def load(path: str | Path | None = None) -> tuple[Choice, ...]:
    """The checked rows of a choices file (default: the shipped one, read once). ValueError
    naming the file and line of the first row that is malformed or that the engine cannot run."""
    if path is None:
        return _shipped()
    path = Path(path)
    return parse(path.read_text(), str(path))


@functools.cache
def _shipped() -> tuple[Choice, ...]:
    return parse(SHIPPED.read_text(), str(SHIPPED))


def parse(text: str, name: str = "<choices>") -> tuple[Choice, ...]:
    """`load` on a file's text; `name` is what the errors call the file."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{name}: not TOML: {e}") from None
    extra = set(data) - {"choice"}
    if extra or not isinstance(data.get("choice"), list):
        raise ValueError(f"{name}: expected [[choice]] rows only, got keys {sorted(data)}")
    lines = [i + 1 for i, s in enumerate(text.splitlines()) if ROW_HEADER.match(s)]
    if len(lines) != len(data["choice"]):
        lines = [0] * len(data["choice"])  # inline arrays: no line to name
    choices = tuple(_row(r, f"{name}:{line}", line) for r, line in zip(data["choice"], lines))
    _check(choices, name)
    return choices


def _row(raw: dict, where: str, line: int) -> Choice:
    """One [[choice]] table -> Choice, each field's type and value checked."""
    unknown = sorted(set(raw) - set(FIELDS))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; a row has {list(FIELDS)}")
    missing = [f for f in ("chip", "op", "candidate", "measured", "source") if f not in raw]
    if missing:
        raise ValueError(f"{where}: missing field(s) {missing}")
    for f in ("chip", "op", "candidate", "source"):
        if not isinstance(raw[f], str) or not raw[f]:
            raise ValueError(f"{where}: {f} must be a non-empty string, got {raw[f]!r}")
    if not isinstance(raw["measured"], bool):
        raise ValueError(f"{where}: measured must be true or false, got {raw['measured']!r}")
    op, candidate = raw["op"], raw["candidate"]
    if op not in CANDIDATES:
        raise ValueError(f"{where}: unknown op {op!r}; one of {list(CANDIDATES)}")
    if candidate not in CANDIDATES[op]:
        raise ValueError(
            f"{where}: unknown candidate {candidate!r} for {op}; one of {list(CANDIDATES[op])}"
        )
    lo, hi = raw.get("min_rows"), raw.get("max_rows")
    if op in ATTENTION_OPS and (lo is not None or hi is not None):
        raise ValueError(f"{where}: {op} takes no rows bucket (one choice for every shape)")
    if op in MATMUL_OPS:
        if not _count(lo) or not (hi is None or _count(hi) and hi >= lo):
            raise ValueError(
                f"{where}: {op} needs min_rows >= 1 and max_rows >= min_rows (or no max_rows), "
                f"got min_rows={lo!r} max_rows={hi!r}"
            )
    fields = {f: raw[f] for f in ("chip", "op", "candidate", "measured", "source")}
    return Choice(**fields, min_rows=lo, max_rows=hi, line=line)


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _check(choices: tuple[Choice, ...], name: str) -> None:
    """Every chip complete, and a table the engine can run (see the module doc)."""
    chips = list(dict.fromkeys(c.chip for c in choices))
    if DEFAULT_CHIP not in chips:
        raise ValueError(f"{name}: no rows for chip {DEFAULT_CHIP!r} (a GPU no chip name matches)")
    for chip in chips:
        rows = [c for c in choices if c.chip == chip]
        for op in ATTENTION_OPS:
            on = [c for c in rows if c.op == op]
            if len(on) != 1:
                where = f"{name}:{on[1].line}" if on else name
                raise ValueError(f"{where}: chip {chip!r} needs one {op} row, has {len(on)}")
        decode, prefill = (next(c for c in rows if c.op == op) for op in ATTENTION_OPS)
        if decode.candidate != prefill.candidate:
            raise ValueError(
                f"{name}:{prefill.line}: chip {chip!r}: prefill_attention {prefill.candidate!r} "
                f"but decode_attention {decode.candidate!r} (line {decode.line}); the engine runs "
                "one attention implementation for both (ModelImpl.attention)"
            )
        kernels = {}
        for op in MATMUL_OPS:
            kernels[op] = _check_buckets([c for c in rows if c.op == op], chip, op, name)
        named = {k for k in kernels.values() if k}
        if len(named) > 1:
            raise ValueError(
                f"{name}: chip {chip!r}: int4_matmul runs {kernels['int4_matmul']!r} and w8_matmul "
                f"{kernels['w8_matmul']!r}; the engine sets one impl on every quantized weight "
                "(quant.with_matmul_impl)"
            )


def _check_buckets(rows: list[Choice], chip: str, op: str, name: str) -> str | None:
    """The buckets of one matmul op on one chip: 1 up without gap or overlap, kernels first, one
    kernel, 'xla' last. Returns the kernel (None: 'xla' on every bucket)."""
    if not rows:
        raise ValueError(f"{name}: chip {chip!r} has no {op} rows")
    rows = sorted(rows, key=lambda c: c.min_rows)
    expect, kernel = 1, None
    for prev, c in zip([None, *rows], rows):
        where = f"{name}:{c.line}: chip {chip!r} {op}"
        if (prev is not None and prev.max_rows is None) or c.min_rows < expect:
            other = prev.line if prev is not None else "?"
            raise ValueError(f"{where}: rows from {c.min_rows} overlap the row at line {other}")
        if c.min_rows > expect:
            raise ValueError(f"{where}: no row covers {expect} to {c.min_rows - 1} rows")
        if c.candidate != "xla":
            if kernel not in (None, c.candidate) or (prev is not None and prev.candidate == "xla"):
                raise ValueError(
                    f"{where}: {c.candidate!r} after {prev.candidate!r}; the engine runs one "
                    "kernel on the smallest buckets and XLA's path above them"
                )
            kernel = c.candidate
        expect = (c.max_rows or 0) + 1
    if rows[-1].max_rows is not None:
        raise ValueError(f"{name}:{rows[-1].line}: chip {chip!r} {op}: no row past {expect - 1}")
    if rows[-1].candidate != "xla":
        raise ValueError(
            f"{name}:{rows[-1].line}: chip {chip!r} {op}: the open-ended bucket must be 'xla' "
            "(the kernels serve bounded decode batches)"
        )
    return kernel


def to_toml(choices: tuple[Choice, ...]) -> str:
    """The file's text: HEADER, then one [[choice]] table a row, in the given order."""
    out = [HEADER]
    for c in choices:
        out.append("[[choice]]")
        for f in FIELDS:
            v = getattr(c, f)
            if v is not None:
                text = (
                    ("true" if v else "false")
                    if isinstance(v, bool)
                    else json.dumps(v, ensure_ascii=False)
                )
                out.append(f"{f} = {text}")
        out.append("")
    return "\n".join(out)


def attention_misfit(attention: str, head_dim: int) -> str | None:
    """Why the GPU attention kernels `attention` ('pallas', 'mgpu' and their interpret modes)
    cannot run a model of heads `head_dim` wide, or None. The Triton kernels tile the head
    dimension in powers of two (Phi-3-mini's 96 is not one), and 'mgpu' hands them every call its
    Mosaic GPU kernels refuse (`layers/attention.py`). On GPU 'auto' then takes 'reference', XLA's
    gather form (the H200 timed it at 57.5 us against the Triton kernel's 203.4 us at 512
    tokens: JOURNAL.md 48b)."""
    if attention.startswith(("pallas", "mgpu")) and head_dim & (head_dim - 1):
        return f"the Triton kernels need a power-of-two head_dim, got {head_dim}"
    return None


# The command types XLA:GPU may record into CUDA graphs: its defaults, and while loops and
# conditionals, which inside a graph are decided on the device (outside one, XLA's
# ConditionalThunk, and a WhileThunk without a known trip count, copy the predicate to the host
# and wait: a host round trip inside the step). The sampler's conditionals (`runner/sampling.py`)
# and the layer loop then run within one graph launch. DYNAMIC_SLICE_FUSION: cuBLAS reading a
# layer of its stack in place (driver, runtime and toolkit 12.9 or newer).
GPU_COMMAND_BUFFER = (
    "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL,DYNAMIC_SLICE_FUSION"
)


def gpu_compiler_options(
    plain_weights: bool, autotune_cache_dir: str | None = None
) -> tuple[tuple[str, str], ...]:
    """The XLA options of a GPU engine's programs (`jaxserve.bench.gpu_programs` shows what each
    does to the compiled program).

    plain_weights (every layer weight a float array, none quantized): GEMMs through cuBLAS, which
    reads each layer's weight in place from its [L, K, N] stack (XLA's dynamic-slice fusion), where
    a Triton GEMM under the layer scan gets the layer copied out of the stack first (84-87% of a
    decode step's weight bytes written and read again: experiments/JOURNAL.md 54); and no dot
    merging, which concatenates q/k/v (gate/up) weights into a new buffer to run one GEMM.
    Quantized weights keep XLA's default (Triton GEMMs that dequantize in their prologue; the INT4
    kernel reads its stack in place).
    Every program: CUDA graphs (`GPU_COMMAND_BUFFER`), with loops of a known trip count (the
    layer scan) recorded unrolled (`xla_gpu_command_buffer_unroll_loops`). XLA keeps a loop whose
    body reads its stacks at the iteration's offset (cuBLAS through a dynamic-slice fusion) out of
    graphs unless it unrolls it: then each layer is a graph launch of its own from the host
    (Llama-3-8B bf16 decode: 40 host launches a step against 1; JOURNAL.md 64a).
    autotune_cache_dir: where XLA keeps its per-fusion autotuning results across processes
    (`runner/compile_cache.py`)."""
    options = {
        "xla_gpu_enable_command_buffer": GPU_COMMAND_BUFFER,
        "xla_gpu_command_buffer_unroll_loops": "True",
    }
    if autotune_cache_dir:
        options["xla_gpu_per_fusion_autotune_cache_dir"] = autotune_cache_dir
    if plain_weights:
        options |= {"xla_gpu_enable_triton_gemm": "False", "xla_gpu_dot_merger_threshold_mb": "0"}
    return tuple(sorted(options.items()))


__all__ = [
    "ATTENTION_OPS",
    "CANDIDATES",
    "DEFAULT_CHIP",
    "KERNELS",
    "MATMUL_OPS",
    "ChipChoices",
    "Choice",
    "GPU_COMMAND_BUFFER",
    "attention_misfit",
    "chip_of",
    "for_chip",
    "for_device",
    "gpu_compiler_options",
    "load",
    "parse",
    "to_toml",
]
