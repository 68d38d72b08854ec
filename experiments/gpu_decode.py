"""The engine's decode step on one GPU (issue 54, decode at the memory roofline): Llama-3-8B, bf16,
INT4 and INT8, at 1 / 8 / 64 slots and 1024 / 4096 tokens of context, each timed under the engine's
XLA options, the same without the layer loop unrolled into its CUDA graph, and XLA's defaults,
side by side in one process.

    python experiments/gpu_decode.py [--out DIR] [--budget_s 360] [--profile]   # a lent H100/H200
    python experiments/gpu_decode.py --smoke [--profile]    # CPU: tiny preset, interpret mode

1. The device's own GpuTargetConfigProto (`target_config`): a tiny jitted function compiled with
   `xla_dump_to`; XLA's `*gpu_target_config.pbtxt` is copied to DIR/target_config.txtpb, which a
   later CPU session compiles for exactly this device with (`jaxserve.bench.deviceless.target`).
   None on the CPU (--smoke): skipped, and said so.
2. Cases (`cases`), in order of context, then slots, then weights: random Llama-3-8B weights
   (`llama.init_params`, bf16 in the engine's GPU layout, q/k/v and gate/up each one stack
   (`resolve.weight_layout` 'fused', JOURNAL.md 64b; INT8 too), and 'bf16-sep' the same weights as
   separate stacks (the layout before 64b), at the first context only, freed after its last case;
   INT4 = `quantize_params(..., "int4-rtn")` with the Pallas kernel
   up to 16 rows and XLA's unpack + dot above, as the shipped GPU kernel table has it, and
   'int4-k64' the same weights with the kernel at every decode size, above 16 slots only;
   INT8 = per-channel, with the W8A16 kernel `pallas_kernels/w8_matmul.py`, never run on a GPU
   before this script),
   every slot active at `context` tokens (K/V pool filled with pseudo-random values, each slot's
   pages a random permutation of the pool's), page-table width the engine's bucket for an engine
   of max_model_len 8192. A decode step is what `ModelRunner.generate` runs on one device:
   `steps.decode_forward` then `steps.decode_sample` (greedy, no log-probs), the cache donated to
   the forward and the slot state to the sampler, reassigned after each call. Each timed run
   starts from the same slot state (context `context`), dispatches `--steps` steps and blocks once;
   median ms per step over `--repeats` runs per variant. The variants, alternated A/B/C/A/B/C:
     engine        `Resolved.compiler_options` (gpu_choices.gpu_compiler_options: CUDA graphs with
                   while loops and conditionals, the layer loop recorded unrolled; for bf16 also
                   cuBLAS GEMMs, no dot merging); without the autotuning cache folder a runner
                   with a compilation cache adds (it says where results are kept, not what runs)
     no_unroll     the same without `xla_gpu_command_buffer_unroll_loops`: XLA then keeps the
                   layer loop out of CUDA graphs (its cuBLAS calls read the stacks at the
                   iteration's offset), each layer one graph launch (JOURNAL.md 64a)
     xla_default   () -- XLA's defaults, what the engine compiled with before those options
   Before timing, each runs `--check_steps` steps from the same state: their greedy tokens are
   compared with the engine's (`tokens_match`), and the first step's logits (the largest
   max |diff| / max |logit| of a variant against the engine's); random
   weights make near-ties likely, so a mismatch after a small logit difference is rounding (cuBLAS
   vs Triton GEMMs), not a wrong program.
   Roofline: (weight bytes a step reads + KV bytes it reads) / HBM bandwidth, bandwidth from the
   device kind (H100 SXM 3.35e12 B/s, H200 4.8e12; `--hbm_gbps` overrides). Weight bytes: every
   param but an untied embedding table (a decode step gathers its B rows only); KV bytes: each
   slot's mean context over a run (context + steps / 2) x K/V bytes per token.
3. `--profile`, right after its case: the faster variant of that case (`--profile_case`, default
   bf16:1:1024) compiled once more with `xla_enable_command_buffers_during_profiling=True` (CUDA graphs kept, as timed),
   `--profile_steps` steps under `jax.profiler.trace(create_perfetto_trace=True)`, the trace
   reduced in plain Python to a per-kernel table (name, calls per step, us per step, share):
   DIR/profile_kernels.md, `profile` in the JSON, and the trace as DIR/profile_trace.json.gz.
   On the CPU the trace has no GPU kernels: the table lists the XLA CPU client's thunks instead,
   labelled so.
4. `--budget_s` (from the start of main): a case is begun only if the slowest case so far fits in
   what is left (with `--profile`, less a reserve for it); the rest are listed as skipped.
   DIR/gpu_decode.json and DIR/gpu_decode.md are rewritten after every case, so a timeout keeps
   what finished. DIR defaults to $OUT, else experiments/out/gpu_decode.

--smoke runs every path above on the CPU in well under a minute (the target config skipped): the
tiny preset, Pallas kernels in interpret mode, 2 steps; its timings and roofline shares mean
nothing and are labelled so.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

if "--smoke" in sys.argv:  # before jax starts: the CPU, whatever plugins are installed
    os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")  # JAX's GPU default is 0.75

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxserve.bench import deviceless  # noqa: E402
from jaxserve.config import EngineConfig, ModelConfig  # noqa: E402
from jaxserve.layers import kv_cache  # noqa: E402
from jaxserve.layers.embedding import is_quantized  # noqa: E402
from jaxserve.layers.linear import fuse_projections  # noqa: E402
from jaxserve.models import llama  # noqa: E402
from jaxserve.quant import quantize_params, with_matmul_impl  # noqa: E402
from jaxserve.resolve import resolve  # noqa: E402
from jaxserve.runner import memory, slot_state, steps  # noqa: E402

FULL = dict(
    model="llama3-8b",
    weights=("bf16", "bf16-sep", "int4", "int8", "int4-k64"),
    slots=(1, 8, 64),
    contexts=(1024, 4096),
    max_model_len=8192,
    steps=32,
    repeats=5,
    check_steps=4,
    attention="auto",  # resolve: the Pallas Triton kernels on GPU
    int4_impl="pallas",  # the INT4 and W8A16 kernels
    first_case_guess_s=60.0,
    profile_reserve_s=45.0,
    profile_steps=8,
)
SMOKE = dict(
    model="tiny",
    weights=("bf16", "bf16-sep", "int4", "int8", "int4-k64"),
    slots=(2,),
    contexts=(40,),
    max_model_len=512,
    steps=2,
    repeats=2,
    check_steps=2,
    attention="pallas_interpret",
    int4_impl="pallas_interpret",
    first_case_guess_s=0.0,
    profile_reserve_s=0.0,
    profile_steps=2,
)
PAGE_SIZE = 16
VARIANTS = ("engine", "no_unroll", "xla_default")
UNROLL = "xla_gpu_command_buffer_unroll_loops"
WANT_TOP = np.bool_(False)  # greedy, no log-probs: the runner's flag, sent with every sample call
# HBM bandwidth by device kind (datasheet, bytes/s); the first match in the kind's name wins
BANDWIDTH = (
    ("H100 PCIe", 2.0e12),
    ("H100 NVL", 3.9e12),
    ("H100", 3.35e12),  # SXM, "NVIDIA H100 80GB HBM3"
    ("H200", 4.8e12),
)
NOMINAL_BANDWIDTH = 3.35e12  # a CPU smoke run's roofline: an H100's, meaningless there
SMOKE_NOTE = "smoke run on the CPU: timings, tokens/s and roofline shares are meaningless"


# -- 1. the device's target config ----------------------------------------------------------------
def save_target_config(out: Path) -> dict:
    """DIR/target_config.txtpb: the GpuTargetConfigProto XLA dumps when it compiles for this
    device (a tiny function compiled with xla_dump_to)."""
    if jax.default_backend() != "gpu":
        return dict(skipped=f"backend {jax.default_backend()}: XLA writes no GPU target config")
    with tempfile.TemporaryDirectory() as dump:
        f = jax.jit(lambda x: x * 2 + 1, compiler_options={"xla_dump_to": dump})
        f(jnp.arange(8, dtype=jnp.float32)).block_until_ready()
        found = sorted(glob.glob(os.path.join(dump, "*gpu_target_config.pbtxt")))
        if not found:
            return dict(error="no *gpu_target_config.pbtxt in the dump", files=os.listdir(dump))
        path = out / "target_config.txtpb"
        shutil.copyfile(found[0], path)
    row = dict(path=str(path), dumped_as=os.path.basename(found[0]))
    try:  # what a CPU session's deviceless.target(path) will read from it
        t = deviceless.target(str(path))
        row.update(
            device_kind=t.device_kind, memory_bandwidth=t.memory_bandwidth, num_cores=t.num_cores
        )
    except ValueError as e:
        row["parse_error"] = str(e)
    print(f"target config: {row}")
    return row


def bandwidth(device_kind: str, override_gbps: float | None) -> tuple[float, str]:
    """(HBM bytes/s, where the number comes from)."""
    if override_gbps:
        return override_gbps * 1e9, "--hbm_gbps"
    for name, bw in BANDWIDTH:
        if name in device_kind:
            return bw, f"datasheet ({name})"
    return NOMINAL_BANDWIDTH, f"nominal H100 SXM (unknown device kind {device_kind!r})"


# -- 2. the cases ---------------------------------------------------------------------------------
QUANTIZATION = {"int4": "int4-rtn", "int8": "int8"}
# 'int4-k64': the INT4 params with the kernel at every decode size (16-row blocks, JOURNAL.md 61b),
# where the engine's table runs XLA's unpack + dot above 16 rows: the 17-64 row choice (issue 54)
# timed in the engine's own step. Only cases above 16 slots (below, it is 'int4'); any in --smoke.
KERNEL_ALL_ROWS = {"int4_matmul": 64}


def make_params(c: ModelConfig, weights: str, kernel_impl: str, bf16=None):
    """Random params of `weights` ('bf16'; 'int4' / 'int8': `bf16`, the given bf16 params,
    quantized, their kernels' impl `kernel_impl`)."""
    if weights == "bf16":
        # outside jit: one program per weight shape, so the peak is the params + one f32 draw
        return llama.init_params(c, jax.random.key(0), jnp.bfloat16)
    q = jax.jit(lambda p: quantize_params(p, c, QUANTIZATION[weights]))(bf16)
    return with_matmul_impl(q, kernel_impl)


def weight_bytes_per_step(params, rows: int, c: ModelConfig) -> int:
    """Bytes of params a decode step reads: all of them, but of an untied embedding table only
    the B rows it gathers."""
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    if "lm_head" in params:
        embed = params["embed"]
        size = sum(x.nbytes for x in jax.tree.leaves(embed))
        total -= size - rows * size // c.vocab_size
    return total


def _pseudo_random(shape, dtype, salt: int):
    """Uniform(-1, 1) values of `shape` from an iota hash: one fused loop writing `dtype`, no f32
    or random-bits temporary as large as the array (a 64-slot 4096-token pool is 32 GiB)."""
    i = jnp.zeros(shape, jnp.uint32)
    for d, n in enumerate(shape):  # the flat index mod 2^32
        i = i * jnp.uint32(n) + jax.lax.broadcasted_iota(jnp.uint32, shape, d)
    x = (i + jnp.uint32(salt * 0x9E3779B9 & 0xFFFFFFFF)) * jnp.uint32(2654435761)
    x = x ^ (x >> 15)
    return ((x >> 8).astype(jnp.float32) * (2.0 / 2**24) - 1.0).astype(dtype)


def make_case(c: ModelConfig, spec: dict, slots: int, context: int, plain: bool):
    """(resolved, decode shape, cache, initial slot state, pages) of one case: every slot
    active at `context` tokens with room for the runs' steps, in the engine's width bucket."""
    ec = EngineConfig(
        num_slots=slots,
        max_model_len=spec["max_model_len"],
        page_size=PAGE_SIZE,
        attention_impl=spec["attention"],
    ).for_model(c)
    r = resolve(ec, c, "gpu", plain_weights=plain)
    longest = context + max(spec["steps"], spec["check_steps"], spec["profile_steps"]) + 2
    need = -(-longest // PAGE_SIZE)  # pages each slot holds
    shape = r.decode_shape(slots - 1, [need] * slots)
    num_pages = slots * need
    if r.model.attention.startswith("pallas"):
        if memory.pallas_pool_pages(num_pages, c, ec) != num_pages:
            raise ValueError(f"a pool of {num_pages} pages is unsafe for the Pallas kernels")

    @jax.jit
    def init():
        cache = steps.init_cache(c, num_pages, PAGE_SIZE, "auto", jnp.bfloat16)
        return cache.replace(
            k=_pseudo_random(cache.k.shape, cache.k.dtype, 1),
            v=_pseudo_random(cache.v.shape, cache.v.dtype, 2),
        )

    rng = np.random.default_rng(slots * 100003 + context)
    table = np.zeros((slots, r.max_pages), np.int32)  # pages past a slot's own: never read
    table[:, :need] = rng.permutation(num_pages).reshape(slots, need)
    state = slot_state.init_slot_state(slots, r.max_pages, c.vocab_size)
    state = state.replace(
        last_token=jnp.asarray(rng.integers(0, c.vocab_size, slots), jnp.int32),
        seq_len=jnp.full((slots,), context, jnp.int32),
        max_total_len=jnp.full((slots,), need * PAGE_SIZE, jnp.int32),
        active=jnp.ones((slots,), bool),
        page_table=jnp.asarray(table),
    )
    return r, shape, init(), state, num_pages


def fresh(state):
    """A copy of the initial slot state (the sampler donates the one it is given)."""
    return jax.block_until_ready(jax.tree.map(jnp.copy, state))


def decode_steps(fns, params, cache, state, n: int, static: dict, shape):
    """n engine decode steps (forward, then sample), dispatched back to back, unblocked ->
    (cache, state, [tokens i32[1, B] per step], the first step's logits)."""
    forward, sample = fns
    tokens, first = [], None
    for _ in range(n):
        cache, logits = forward(params, cache, state, **static)
        state, out = sample(state, logits, WANT_TOP, num_top=shape.num_top)
        tokens.append(out.tokens)
        first = logits if first is None else first
    return cache, state, tokens, first


def run_case(params, c, weights, slots, context, spec, bw) -> tuple[dict, dict]:
    """One case's row (both variants) and what the profile needs to run it again."""
    plain = not any(map(is_quantized, params["layers"].values()))
    r, shape, cache, state0, num_pages = make_case(c, spec, slots, context, plain)
    no_unroll = tuple((k, v) for k, v in r.compiler_options if k != UNROLL)
    options = {"engine": r.compiler_options, "no_unroll": no_unroll, "xla_default": ()}
    static = dict(config=c, impl=r.model, shape=shape)
    fns = {v: (steps.decode_forward.jit(o), steps.decode_sample.jit(o)) for v, o in options.items()}
    row = dict(
        weights=weights,
        slots=slots,
        context=context,
        rows=shape.rows,
        width=shape.width,
        num_pages=num_pages,
        attention=r.model.attention,
        options={v: dict(o) for v, o in options.items()},
    )

    # Same tokens? Each variant from the same state; this also compiles both (first call timed).
    toks, logits = {}, {}
    for v in VARIANTS:
        t0 = time.perf_counter()
        cache, st, t, first = decode_steps(
            fns[v], params, cache, fresh(state0), spec["check_steps"], static, shape
        )
        toks[v] = np.concatenate(jax.device_get(t))  # (check_steps, B)
        logits[v] = np.asarray(first, np.float32)
        row[f"{v}_check_s"] = time.perf_counter() - t0  # compile + check_steps steps
        del st
    a, others = logits["engine"], [v for v in VARIANTS if v != "engine"]
    row["tokens_match"] = all(np.array_equal(toks["engine"], toks[v]) for v in others)
    row["first_tokens_match"] = all(np.array_equal(toks["engine"][0], toks[v][0]) for v in others)
    row["logits_max_rel_diff"] = max(
        float(np.max(np.abs(a - logits[v])) / max(np.max(np.abs(a)), 1e-30)) for v in others
    )

    # Timing: A/B/A/B, each run from the initial state, N steps dispatched, one block.
    per_step = {v: [] for v in VARIANTS}
    for _ in range(spec["repeats"]):
        for v in VARIANTS:
            st = fresh(state0)
            t0 = time.perf_counter()
            cache, st, t, _ = decode_steps(fns[v], params, cache, st, spec["steps"], static, shape)
            jax.block_until_ready((cache, st))
            per_step[v].append((time.perf_counter() - t0) / spec["steps"])
            del st, t

    kv_token = kv_cache.bytes_per_token(
        c.num_layers, c.num_kv_heads, c.head_dim, "auto", jnp.bfloat16
    )
    w_bytes = weight_bytes_per_step(params, shape.rows, c)
    kv_bytes = slots * (context + spec["steps"] // 2) * kv_token
    roof = (w_bytes + kv_bytes) / bw
    row.update(weight_bytes=w_bytes, kv_bytes=kv_bytes, roofline_ms=roof * 1e3)
    for v in VARIANTS:
        med = statistics.median(per_step[v])
        row[v] = dict(
            step_ms=med * 1e3,
            step_ms_runs=[x * 1e3 for x in per_step[v]],
            tokens_per_s=slots / med,
            roofline_fraction=roof / med,
            achieved_GBps=(w_bytes + kv_bytes) / med / 1e9,
        )
    row["xla_default_over_engine"] = row["xla_default"]["step_ms"] / row["engine"]["step_ms"]
    row["no_unroll_over_engine"] = row["no_unroll"]["step_ms"] / row["engine"]["step_ms"]
    row["best"] = min(VARIANTS, key=lambda v: row[v]["step_ms"])
    live = dict(cache=cache, state0=state0, options=options, static=static, shape=shape)
    return row, live


# -- 3. the profile -------------------------------------------------------------------------------
def _trace_file(trace_dir: Path) -> Path | None:
    for pattern in ("**/perfetto_trace.json.gz", "**/*.trace.json.gz"):
        found = sorted(trace_dir.glob(pattern))
        if found:
            return found[0]
    return None


def kernel_table(trace_path: Path, num_steps: int, on_gpu: bool) -> dict:
    """The trace's device kernels summed by name, per step: from the GPU process's stream
    threads; on a CPU-only trace, the XLA CPU client's thunk events instead (labelled so)."""
    with gzip.open(trace_path, "rt") as f:
        events = json.load(f)["traceEvents"]
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    gpu = {p for p, name in procs.items() if "GPU" in name or "gpu" in name}
    streams = {k for k in threads if k[0] in gpu and threads[k].startswith("Stream")}
    if streams:
        source, keep = "GPU streams (CUPTI kernels, memcpys)", streams
    elif gpu:  # no stream lines: every line of the device but XLA's derived op/module lines
        derived = ("XLA Modules", "XLA Ops", "Framework", "Steps", "Source", "TensorFlow")
        keep = {k for k in threads if k[0] in gpu and not threads[k].startswith(derived)}
        source = "GPU device lines"
    elif on_gpu:
        keep, source = set(), "no GPU device events in the trace (is CUPTI loadable?)"
    else:  # a thunk that holds others (a while loop) counts their time too
        keep = {k for k, name in threads.items() if name.startswith("tf_XLAPjRtCpuClient")}
        source = "CPU host thunks, nested (no GPU: not kernels)"
    skip = ("ThreadpoolListener", "ThunkExecutor", "end: ")
    calls, total, ops = collections.Counter(), collections.Counter(), {}
    for e in events:
        if e.get("ph") != "X" or (e.get("pid"), e.get("tid")) not in keep:
            continue
        name = e["name"]
        if name.startswith(skip):
            continue
        calls[name] += 1
        total[name] += float(e.get("dur", 0.0))
        op = (e.get("args") or {}).get("hlo_op")
        if op and name not in ops:
            ops[name] = op
    whole = sum(total.values())
    rows = [
        dict(
            name=name,
            hlo_op=ops.get(name, ""),
            calls_per_step=calls[name] / num_steps,
            us_per_step=us / num_steps,
            share=us / whole if whole else 0.0,
        )
        for name, us in total.most_common()
    ]
    return dict(source=source, steps=num_steps, us_per_step=whole / num_steps, kernels=rows)


def kernel_markdown(prof: dict, top: int = 40) -> str:
    head = (
        f"Per-kernel table: {prof['case']}, variant {prof['variant']}, {prof['steps']} steps, "
        f"source: {prof['source']}; kernel time {prof['us_per_step']:.1f} us per step of "
        f"{prof['wall_ms_per_step'] * 1e3:.1f} us wall\n\n"
        "| kernel | HLO op | calls / step | us / step | share |\n|---|---|---|---|---|\n"
    )
    lines = [
        f"| `{k['name'][:90]}` | {k['hlo_op'][:40]} | {k['calls_per_step']:.2f} | "
        f"{k['us_per_step']:.1f} | {k['share']:.1%} |"
        for k in prof["kernels"][:top]
    ]
    rest = prof["kernels"][top:]
    if rest:
        us = sum(k["us_per_step"] for k in rest)
        lines.append(f"| ({len(rest)} more) | | | {us:.1f} | |")
    return head + "\n".join(lines) + "\n"


def profile_case(params, live: dict, variant: str, spec: dict, out: Path, case: str) -> dict:
    """The case's `variant` again with CUDA graphs kept under the profiler, traced, reduced."""
    opts = dict(live["options"][variant])
    opts["xla_enable_command_buffers_during_profiling"] = "True"
    opts = tuple(sorted(opts.items()))
    fns = (steps.decode_forward.jit(opts), steps.decode_sample.jit(opts))
    n, static, shape = spec["profile_steps"], live["static"], live["shape"]
    cache = live["cache"]
    cache, st, _, _ = decode_steps(fns, params, cache, fresh(live["state0"]), 2, static, shape)
    jax.block_until_ready((cache, st))  # compiled, warm
    trace_dir = Path(tempfile.mkdtemp(prefix="gpu_decode_trace_"))
    st = fresh(live["state0"])
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        t0 = time.perf_counter()
        cache, st, _, _ = decode_steps(fns, params, cache, st, n, static, shape)
        jax.block_until_ready((cache, st))
        wall = (time.perf_counter() - t0) / n
    live["cache"] = cache
    path = _trace_file(trace_dir)
    if path is None:
        return dict(case=case, variant=variant, error=f"no trace file under {trace_dir}")
    prof = dict(case=case, variant=variant, options=dict(opts), wall_ms_per_step=wall * 1e3)
    prof.update(kernel_table(path, n, jax.default_backend() == "gpu"))
    shutil.copyfile(path, out / "profile_trace.json.gz")
    shutil.rmtree(trace_dir, ignore_errors=True)
    (out / "profile_kernels.md").write_text(kernel_markdown(prof))
    return prof


def run_profile(params, live, row: dict, spec: dict, out: Path, opts, t_start: float) -> dict:
    """`profile_case` of the case's faster variant, if it ran and the budget allows."""
    if live is None:
        return dict(skipped=f"case {opts.profile_case} failed: {row.get('error', '')[:300]}")
    if opts.budget_s - (time.perf_counter() - t_start) < 0.5 * spec["profile_reserve_s"]:
        return dict(skipped="no budget left")
    try:
        prof = profile_case(params, live, row["best"], spec, out, opts.profile_case)
        print(kernel_markdown(prof) if "kernels" in prof else prof)
        return prof
    except Exception as e:  # noqa: BLE001 - no CUPTI, say so
        return dict(error=f"{type(e).__name__}: {e}"[:2000])


# -- 4. the report --------------------------------------------------------------------------------
def table(result: dict) -> str:
    head = (
        f"{result['card']} ({result['device_kind']}), roofline at {result['hbm_bytes_per_s'] / 1e12:.2f} "
        f"TB/s ({result['bandwidth_source']})"
        + (f"; {SMOKE_NOTE}" if result["smoke"] else "")
        + "\n\n| weights | slots | ctx | width | roofline ms | engine ms | no_unroll ms | "
        "xla_default ms | default / engine | engine tok/s | engine of roofline | "
        "default of roofline | tokens match |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in result["cases"]:
        key = f"| {r['weights']} | {r['slots']} | {r['context']} |"
        if "engine" not in r:
            lines.append(f"{key} {r.get('skipped') or r.get('error', '')[:120]} |" + " |" * 9)
            continue
        e, n, d = r["engine"], r["no_unroll"], r["xla_default"]
        match = (
            "yes" if r["tokens_match"] else f"NO (logits rel diff {r['logits_max_rel_diff']:.1e})"
        )
        lines.append(
            f"{key} {r['width']} | {r['roofline_ms']:.2f} | {e['step_ms']:.2f} | "
            f"{n['step_ms']:.2f} | {d['step_ms']:.2f} | {r['xla_default_over_engine']:.2f}x | "
            f"{e['tokens_per_s']:.0f} | {e['roofline_fraction']:.0%} | "
            f"{d['roofline_fraction']:.0%} | {match} |"
        )
    return head + "\n".join(lines) + "\n"


def main() -> None:
    t_start = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny preset, interpret mode, CPU")
    parser.add_argument("--out", default=os.environ.get("OUT") or "experiments/out/gpu_decode")
    parser.add_argument("--budget_s", type=float, default=360.0, help="stop starting cases after")
    parser.add_argument(
        "--weights", default=None, help="comma-separated: bf16,bf16-sep,int4,int8,int4-k64"
    )
    parser.add_argument("--slots", default=None, help="comma-separated decode slot counts")
    parser.add_argument("--contexts", default=None, help="comma-separated context lengths")
    parser.add_argument("--steps", type=int, default=None, help="decode steps per timed run")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per variant")
    parser.add_argument("--check_steps", type=int, default=None, help="steps compared for tokens")
    parser.add_argument("--profile_steps", type=int, default=None, help="steps traced")
    parser.add_argument("--hbm_gbps", type=float, default=None, help="override the bandwidth")
    parser.add_argument("--profile", action="store_true", help="per-kernel table of one case")
    parser.add_argument(
        "--profile_case", default="bf16:1:1024", help="weights:slots:context to profile"
    )
    opts = parser.parse_args()
    spec = dict(SMOKE if opts.smoke else FULL)
    for name, cast in (("weights", str), ("slots", int), ("contexts", int)):
        value = getattr(opts, name)
        if value:
            spec[name] = tuple(cast(x) for x in value.split(","))
    for name in ("steps", "repeats", "check_steps", "profile_steps"):
        if getattr(opts, name):
            spec[name] = getattr(opts, name)
    if opts.smoke:
        w, s, x = opts.profile_case.split(":")
        if (int(s), int(x)) not in {(a, b) for a in spec["slots"] for b in spec["contexts"]}:
            opts.profile_case = f"{w}:{spec['slots'][0]}:{spec['contexts'][0]}"
    if not opts.smoke and jax.default_backend() != "gpu":
        raise SystemExit("no GPU: run with --smoke for the CPU check")
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = jax.devices()[0]
    kind = dev.device_kind
    bw, bw_source = bandwidth(kind, opts.hbm_gbps)
    if opts.smoke and not opts.hbm_gbps:
        bw, bw_source = NOMINAL_BANDWIDTH, "nominal H100 SXM: " + SMOKE_NOTE
    card = next((name for name, _ in BANDWIDTH if name in kind), kind)
    c = ModelConfig.preset(spec["model"])
    result = dict(
        device=str(dev),
        device_kind=kind,
        card=card,
        backend=jax.default_backend(),
        hbm_bytes_per_s=bw,
        bandwidth_source=bw_source,
        jax=jax.__version__,
        smoke=opts.smoke,
        note=SMOKE_NOTE if opts.smoke else "",
        model=spec["model"],
        spec=spec,
        cases=[],
    )
    print(f"card: {card} ({kind}); HBM roofline {bw / 1e12:.2f} TB/s ({bw_source})")

    def write():
        result["seconds"] = time.perf_counter() - t_start
        (out / "gpu_decode.json").write_text(json.dumps(result, indent=1, default=str))
        (out / "gpu_decode.md").write_text(table(result))

    result["target_config"] = save_target_config(out)
    write()

    t0 = time.perf_counter()
    params = {"bf16": make_params(c, "bf16", spec["int4_impl"])}
    jax.block_until_ready(params["bf16"])
    for w in ("int4", "int8"):
        if w in spec["weights"] or (w == "int4" and "int4-k64" in spec["weights"]):
            params[w] = make_params(c, w, spec["int4_impl"], params["bf16"])
            jax.block_until_ready(params[w])
    if "int4-k64" in spec["weights"]:  # the same arrays, the kernel's row limit raised
        params["int4-k64"] = with_matmul_impl(params["int4"], spec["int4_impl"], KERNEL_ALL_ROWS)
    if "bf16-sep" in spec["weights"]:  # the separate stacks, as loaded (the layout before 64b)
        params["bf16-sep"] = params["bf16"]
    if "bf16" not in spec["weights"]:
        del params["bf16"]
    for w in ("bf16", "int8"):  # the engine's GPU layout (resolve.weight_layout 'fused')
        if w in params:
            params[w] = {**params[w], "layers": fuse_projections(params[w]["layers"], c.num_layers)}
            jax.block_until_ready(params[w])
    result["params_s"] = time.perf_counter() - t0
    print(f"params ({', '.join(params)}) ready in {result['params_s']:.1f} s")

    cases = [(w, s, x) for x in spec["contexts"] for s in spec["slots"] for w in spec["weights"]]
    cases = [(w, s, x) for w, s, x in cases if w != "int4-k64" or s > 16 or opts.smoke]
    cases = [(w, s, x) for w, s, x in cases if w != "bf16-sep" or x == spec["contexts"][0]]
    reserve = spec["profile_reserve_s"] if opts.profile else 0.0
    if opts.profile and tuple(opts.profile_case.split(":")) not in {
        (w, str(s), str(x)) for w, s, x in cases
    }:
        result["profile"] = dict(skipped=f"case {opts.profile_case} is not among the cases")
        reserve = 0.0
    slowest = spec["first_case_guess_s"]
    for i, (w, s, x) in enumerate(cases):
        left = opts.budget_s - (time.perf_counter() - t_start) - reserve
        if i and slowest > left:
            for w2, s2, x2 in cases[i:]:
                skipped = f"skipped: {left:.0f} s of the budget left, a case takes ~{slowest:.0f}"
                result["cases"].append(dict(weights=w2, slots=s2, context=x2, skipped=skipped))
            print(f"budget: {len(cases) - i} case(s) skipped")
            break
        t0 = time.perf_counter()
        try:
            row, live = run_case(params[w], c, w, s, x, spec, bw)
        except Exception as e:  # noqa: BLE001 - an OOM or compile failure is a result; go on
            row, live = dict(weights=w, slots=s, context=x, error=f"{type(e).__name__}: {e}"), None
        row["case_s"] = time.perf_counter() - t0
        slowest = max(slowest if i else 0.0, row["case_s"])
        result["cases"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "options"}, default=str))
        write()
        if opts.profile and f"{w}:{s}:{x}" == opts.profile_case:
            result["profile"] = run_profile(params[w], live, row, spec, out, opts, t_start)
            reserve = 0.0
            write()
        del live
        if w == "bf16-sep" and all(w2 != w for w2, _, _ in cases[i + 1 :]):
            del params[w]  # its 16 GB: the 4k-context pools of 64 slots need them on an H100
    if opts.profile and "profile" not in result:
        result["profile"] = dict(skipped=f"case {opts.profile_case} did not run (budget)")
    write()
    print(table(result))
    print(f"done in {result['seconds']:.0f} s; wrote {out / 'gpu_decode.json'}")


if __name__ == "__main__":
    main()
