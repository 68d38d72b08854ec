"""Tensor parallelism on GPUs: decode step time at TP 1/2/4/8 against the HBM roofline, and the
share of the step that TP adds (collectives), for a multi-GPU machine.

    python experiments/gpu_tp.py [--out DIR] [--models llama3-8b:bf16,...] [--tp 1,2,4,8]
    python experiments/gpu_tp.py --smoke     # CPU: tiny preset on 4 host devices (~1 minute)

Prepared for an 8-GPU node; on a machine with fewer GPUs each TP above the device count is
skipped and said so (the lent H200 machine has ONE GPU: it can run TP 1 only).

1. Correctness (`correctness`): the engine's decode step (`runner.steps.generate`, Pallas
   attention on GPU) on ONE set of f32 weights (llama3.2-1b at TP 1/2/4/8 on GPU; tiny at TP 1/2/4
   in --smoke, 4 replicating its 2 KV heads), placed by `partition.shard_params`: tokens equal to
   TP 1's, log-probs within 2e-3 (GPU matmuls at "highest" precision).
2. Timing (`timing`): per model:weights (default llama3-8b bf16 and INT4 RTN g128, llama3-70b INT4
   and bf16) x TP x slots (default 1 and 64, every slot active with a 1024-token context):
   dummy weights are generated straight onto their shards (one jitted init with out_shardings;
   nothing whole on one device, so 70B bf16 at TP 8 is fine), and the decode step runs
   `--steps` tokens per call (the engine's lax.scan), best of `--iters` calls. A configuration
   whose per-device params + KV pool exceed the device's memory is skipped and said so.
   - roofline: (bytes of params per device + KV bytes each device reads in a step) / the HBM
     bandwidth (`--hbm_gbps`, 4800 for an H200): the time of a step that only streams its bytes.
   - TP overhead: the same step on ONE device of a "narrow" model, each layer 1/T as wide (heads,
     KV heads, MLP width and vocabulary / T; hidden size and depth unchanged) -- what one device
     of a TP-T mesh computes, without the collectives. step(TP T) - step(narrow) is what TP adds:
     the all-reduces after o/down projections, the logits' gather (and the sampling over the
     whole vocabulary every device repeats). Its share of the TP-T step is reported. Simple and
     honest, but not a profile: `--trace` also writes a jax.profiler trace of the largest TP run
     (TensorBoard / Perfetto), whose NCCL kernels give the collectives' own time.

Results: DIR/gpu_tp.json (written after every row) and the printed table; DIR defaults to $OUT,
else experiments/out/gpu_tp. On CPU only correctness counts (the roofline is an H200's).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:  # before jax is imported: 4 host CPU devices
    os.environ["JAX_PLATFORMS"] = "cpu"
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=4".strip()
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")  # JAX's GPU default is 0.75

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxserve.config import EngineConfig, ModelConfig  # noqa: E402
from jaxserve.layers import kv_cache  # noqa: E402
from jaxserve.models import llama  # noqa: E402
from jaxserve.parallel import partition  # noqa: E402
from jaxserve.parallel.mesh import make_mesh  # noqa: E402
from jaxserve.quant import quantize_params, with_matmul_impl  # noqa: E402
from jaxserve.resolve import DecodeShape, resolve  # noqa: E402
from jaxserve.runner import memory, slot_state, steps  # noqa: E402

FULL = dict(
    models=("llama3-8b:bf16", "llama3-8b:int4", "llama3-70b:int4", "llama3-70b:bf16"),
    tp=(1, 2, 4, 8),
    slots=(1, 64),
    context=1024,
    steps=8,
    iters=5,
    group_size=128,
    check_model="llama3.2-1b",
    check_slots=8,
    check_tp=(1, 2, 4, 8),
)
SMOKE = dict(
    models=("tiny:float32", "tiny:int4"),
    tp=(1, 2),
    slots=(4,),
    context=40,
    steps=2,
    iters=2,
    group_size=32,
    check_model="tiny",
    check_slots=4,
    check_tp=(1, 2, 4),  # 4 > tiny's 2 KV heads: replicated
)
PAGE_SIZE = 16


def table_width(tokens: int) -> int:
    """Page-table width for `tokens`: a power of two of pages, as the engine's width buckets."""
    pages = -(-tokens // PAGE_SIZE)
    return 1 << (pages - 1).bit_length()


def resolved(config: ModelConfig, slots: int, context: int, extra: int):
    """A one-device engine's choices for this backend (attention impl, INT4 matmul)."""
    ec = EngineConfig(num_slots=slots, max_model_len=context + extra, page_size=PAGE_SIZE)
    return resolve(ec.for_model(config), config, jax.default_backend())


def abstract_params(config: ModelConfig, weights: str, group: int):
    """(abstract params, param dtype): weights 'bf16' | 'float32' | 'int4' (RTN, bf16 rest)."""
    dtype = jnp.float32 if weights == "float32" else jnp.bfloat16
    params = jax.eval_shape(lambda k: llama.init_params(config, k, dtype), jax.random.key(0))
    if weights == "int4":
        params = jax.eval_shape(lambda p: quantize_params(p, config, "int4-rtn", group), params)
    return params, dtype


def partitioned(params, config: ModelConfig, t: int):
    """(abstract params after the TP rules, specs, config): `replicate_kv_heads` + `param_specs`."""
    out = {}

    def rules(p):
        p, out["config"] = partition.replicate_kv_heads(p, config, t)
        p, out["specs"] = partition.param_specs(p, out["config"], t)
        return p

    params = jax.eval_shape(rules, params)
    return params, out["specs"], out["config"]


def dummy_on_shards(abstract, shardings, seed: int = 0):
    """Pseudo-random leaves of `abstract`'s shapes, generated straight into `shardings` (one jit
    of an iota hash per leaf: cheap to compile, partitioned like any elementwise op): floats
    uniform in +-0.02, packed INT4 codes random bits, INT4 scales/mins (f16) in [1e-3, 2e-3]."""
    leaves, tree = jax.tree.flatten(abstract)

    def bits(shape, salt: int):
        # The flat index, wrapping mod 2^32 (a 70B weight stack has more elements than that),
        # from one iota per dim: no 1-D iota longer than a dim.
        i = jnp.zeros(shape, jnp.uint32)
        for d, n in enumerate(shape):
            i = i * jnp.uint32(n) + jax.lax.broadcasted_iota(jnp.uint32, shape, d)
        x = (i + jnp.uint32(salt * 0x9E3779B9 & 0xFFFFFFFF)) * jnp.uint32(2654435761)
        return x ^ (x >> 15)

    def init():
        out = []
        for i, a in enumerate(leaves):
            h = bits(a.shape, seed * 1000 + i + 1)
            u = (h >> 8).astype(jnp.float32) / 2.0**24  # [0, 1)
            if jnp.issubdtype(a.dtype, jnp.unsignedinteger):
                out.append(h.astype(a.dtype))
            elif a.dtype == jnp.float16:  # INT4 scales / mins
                out.append((1e-3 + 1e-3 * u).astype(a.dtype))
            elif jnp.issubdtype(a.dtype, jnp.integer):
                out.append((h % 16).astype(a.dtype) - 8)
            else:
                out.append(((u - 0.5) * 0.04).astype(a.dtype))
        return jax.tree.unflatten(tree, out)

    return jax.jit(init, out_shardings=shardings)()


def local_bytes(abstract, shardings) -> int:
    """Bytes one device holds of `abstract` placed by `shardings` (from shapes only)."""
    total = 0
    for a, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)):
        total += int(np.prod(s.shard_shape(a.shape))) * jnp.dtype(a.dtype).itemsize
    return total


def decode_inputs(config, slots: int, width: int, context: int, dtype, mesh):
    """(cache, state) with every slot active at `context` tokens, slot b owning pages
    [b * width, (b + 1) * width); placed for TP on `mesh` (None: one device)."""
    num_pages = slots * width

    def init():
        cache = kv_cache.init(
            config.num_layers,
            config.num_kv_heads,
            num_pages,
            PAGE_SIZE,
            config.head_dim,
            "auto",
            dtype,
        )
        st = slot_state.init_slot_state(slots, width, config.vocab_size)
        st = st.replace(
            last_token=jnp.arange(slots, dtype=jnp.int32) % config.vocab_size,
            seq_len=jnp.full((slots,), context, jnp.int32),
            max_total_len=jnp.full((slots,), width * PAGE_SIZE, jnp.int32),
            active=jnp.ones((slots,), bool),
            page_table=jnp.arange(num_pages, dtype=jnp.int32).reshape(slots, width),
        )
        return cache, st

    if mesh is None:
        return jax.jit(init)()
    cache_a, state_a = jax.eval_shape(init)
    out = (
        partition.named(mesh, partition.cache_specs(cache_a)),
        partition.named(mesh, partition.replicated(state_a)),
    )
    return jax.jit(init, out_shardings=out)()


def mesh_context(mesh):
    """The steps run under the mesh (layers see its 'model' axis while tracing), as the runner's."""
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()


def run_decode(params, config, impl, cache, state, shape, num_steps: int, iters: int, mesh):
    """(best seconds per call, the first call's DecodeOutput on the host, cache, state)."""
    first, best = None, float("inf")
    with mesh_context(mesh):
        for i in range(iters + 1):
            t0 = time.perf_counter()
            cache, state, out = steps.generate(
                params,
                cache,
                state,
                np.bool_(False),
                config=config,
                impl=impl,
                shape=shape,
                num_steps=num_steps,
            )
            jax.block_until_ready(out)
            dt = time.perf_counter() - t0
            if i == 0:
                first = jax.device_get(out)  # the compile call: not timed
            else:
                best = min(best, dt)
    return best, first, cache, state


def correctness(spec) -> list[dict]:
    """TP-T decode tokens and log-probs against TP 1, on one set of f32 weights."""
    c = ModelConfig.preset(spec["check_model"])
    host = llama.init_params(c, jax.random.key(1), jnp.float32)
    b, steps_, ctx = spec["check_slots"], spec["steps"], spec["context"]
    width = table_width(ctx + steps_ + 1)
    rows, ref = [], None
    # f32 dots on the GPU default to TF32 passes; the CPU's are f32 already (and keeping its
    # default lets the smoke run's timing reuse these compiled steps).
    precision = "highest" if jax.default_backend() == "gpu" else None
    with jax.default_matmul_precision(precision):
        for t in spec["check_tp"]:
            if t > len(jax.devices()):
                rows.append(dict(tp=t, skipped=f"{len(jax.devices())} device(s)"))
                continue
            mesh = make_mesh(t, 1) if t > 1 else None
            p, tc = partition.replicate_kv_heads(host, c, t) if t > 1 else (host, c)
            r = resolved(tc, b, ctx, steps_ + 1)
            p = with_matmul_impl(p, r.quant_matmul)
            p = partition.shard_params(p, tc, mesh) if mesh is not None else p
            cache, state = decode_inputs(tc, b, width, ctx, jnp.float32, mesh)
            # The pool is zeros: every token attends the same values, so the step's numbers are
            # the weights' (what TP must preserve); the K/V the steps write are real.
            shape = DecodeShape(b, width, b * width if r.model.attention == "ragged" else 0)
            _, out, _, _ = run_decode(p, tc, r.model, cache, state, shape, steps_, 0, mesh)
            if ref is None:
                ref = out
            err = float(np.max(np.abs(np.asarray(out.logprobs) - np.asarray(ref.logprobs))))
            same = bool(np.array_equal(out.tokens, ref.tokens))
            rows.append(
                dict(
                    model=c.name,
                    tp=t,
                    tokens_equal=same,
                    max_logprob_err=err,
                    ok=same and err < 2e-3,
                )
            )
            print(f"correctness {c.name} TP {t}: tokens equal {same}, max |dlogprob| {err:.1e}")
    return rows


def narrow(config: ModelConfig, t: int) -> ModelConfig:
    """One TP-T device's share as a one-device model: heads, KV heads, MLP and vocab / T."""
    kvh = max(1, config.num_kv_heads // t)
    vocab = config.vocab_size // t if config.vocab_size % t == 0 else config.vocab_size
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // t,
        num_kv_heads=kvh,
        intermediate_size=config.intermediate_size // t,
        vocab_size=vocab,
        name=f"{config.name}/narrow{t}",
    )


def device_limit() -> int | None:
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def _steps_over_slots(params, config, weights, slots, spec, mesh, trace_dir=None) -> dict:
    """{slots: seconds per decode step} for one placed model, every slot count in turn (a
    count whose KV pool would not fit is left out)."""
    ctx, n = spec["context"], spec["steps"]
    extra = (spec["iters"] + 1) * n + 1
    width = table_width(ctx + extra)
    dtype = jnp.float32 if weights == "float32" else jnp.bfloat16
    t = 1 if mesh is None else mesh.shape["model"]
    kv_token = kv_cache.bytes_per_token(
        config.num_layers, config.num_kv_heads, config.head_dim, "auto", dtype
    )
    free = device_limit()
    if free is not None:
        free -= memory.bytes_on_device(params, jax.local_devices()[0])
    out = {}
    for b in slots:
        if free is not None and b * width * PAGE_SIZE * kv_token // t > 0.85 * free:
            continue
        r = resolved(config, b, ctx, extra)
        cache, state = decode_inputs(config, b, width, ctx, dtype, mesh)
        shape = DecodeShape(b, width, b * width if r.model.attention == "ragged" else 0)
        sec, _, cache, state = run_decode(
            params, config, r.model, cache, state, shape, n, spec["iters"], mesh
        )
        if trace_dir is not None and b == max(slots):  # one more call under the profiler
            with jax.profiler.trace(str(trace_dir)):
                run_decode(params, config, r.model, cache, state, shape, n, 0, mesh)
        del cache, state
        out[b] = sec / n
    return out


def time_config(c, weights, t, slots, spec, hbm_gbps, trace_dir=None) -> list[dict]:
    """Timing rows of one model at TP t (one per slot count): the decode step on t devices, its
    roofline, and (t > 1) the narrow model's step on one device."""
    ctx, n = spec["context"], spec["steps"]
    base = dict(model=c.name, weights=weights, tp=t, context=ctx, steps_per_call=n)
    abstract, dtype = abstract_params(c, weights, spec["group_size"])
    # The INT4 matmul impl is pytree metadata: set it before the specs are built from the tree,
    # or jit's out_shardings ('xla') and the params ('pallas' on a GPU) differ in structure.
    abstract = with_matmul_impl(abstract, resolved(c, 1, ctx, 1).quant_matmul)
    p_abs, specs, tc = partitioned(abstract, c, t)
    mesh = make_mesh(t, 1) if t > 1 else None
    shardings = partition.named(mesh if mesh is not None else make_mesh(1, 1), specs)
    need, limit = local_bytes(p_abs, shardings), device_limit()
    if limit is not None and need > 0.9 * limit:
        skipped = f"params need {need / 1e9:.1f} GB per device of {limit / 1e9:.1f} GB"
        return [dict(base, slots=b, skipped=skipped) for b in slots]
    params = dummy_on_shards(p_abs, shardings)
    p_bytes = memory.bytes_on_device(params, jax.local_devices()[0])
    step = _steps_over_slots(params, tc, weights, slots, spec, mesh, trace_dir)
    del params
    narrow_step = {}
    if t > 1:  # the same per-device work on one device, without collectives
        nc = narrow(c, t)
        n_abs, _ = abstract_params(nc, weights, spec["group_size"])
        n_abs = with_matmul_impl(n_abs, resolved(nc, 1, ctx, 1).quant_matmul)
        one = make_mesh(1, 1)
        n_params = dummy_on_shards(n_abs, jax.tree.map(lambda _: NamedSharding(one, P()), n_abs))
        narrow_step = _steps_over_slots(n_params, nc, weights, slots, spec, None)
        del n_params
    kv_token = kv_cache.bytes_per_token(tc.num_layers, tc.num_kv_heads, tc.head_dim, "auto", dtype)
    rows = []
    for b in slots:
        if b not in step:
            rows.append(dict(base, slots=b, skipped="KV pool does not fit beside the params"))
            continue
        kv_read = b * (ctx + n // 2) * kv_token // t  # the mean context over the call's steps
        roof = (p_bytes + kv_read) / (hbm_gbps * 1e9)
        row = dict(
            base,
            slots=b,
            step_ms=step[b] * 1e3,
            tokens_per_s=b / step[b],
            params_bytes_per_device=p_bytes,
            kv_bytes_read_per_device=kv_read,
            roofline_ms=roof * 1e3,
            roofline_fraction=roof / step[b],
        )
        if b in narrow_step:
            extra = step[b] - narrow_step[b]
            row.update(
                narrow_step_ms=narrow_step[b] * 1e3,
                tp_overhead_ms=extra * 1e3,
                tp_overhead_share=max(0.0, extra / step[b]),
            )
        if trace_dir is not None and b == max(slots):
            row["trace"] = str(trace_dir)
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    head = (
        "| model | weights | TP | slots | step (ms) | tok/s | roofline (ms) | of roofline | "
        "narrow 1-device step (ms) | TP overhead (ms) | share |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        if "skipped" in r:
            lines.append(
                f"| {r['model']} | {r['weights']} | {r['tp']} | {r.get('slots', '')} | "
                f"skipped: {r['skipped']} | | | | | | |"
            )
            continue
        narrow_cols = (
            f"{r['narrow_step_ms']:.2f} | {r['tp_overhead_ms']:.2f} | {r['tp_overhead_share']:.0%}"
            if "narrow_step_ms" in r
            else "- | - | -"
        )
        lines.append(
            f"| {r['model']} | {r['weights']} | {r['tp']} | {r['slots']} | {r['step_ms']:.2f} | "
            f"{r['tokens_per_s']:.0f} | {r['roofline_ms']:.3f} | {r['roofline_fraction']:.0%} | "
            f"{narrow_cols} |"
        )
    return head + "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny preset on 4 CPU devices")
    parser.add_argument("--out", default=os.environ.get("OUT") or "experiments/out/gpu_tp")
    parser.add_argument("--models", default=None, help="comma-separated preset:weights")
    parser.add_argument("--tp", default=None, help="comma-separated tensor-parallel sizes")
    parser.add_argument("--slots", default=None, help="comma-separated decode batch sizes")
    parser.add_argument("--hbm_gbps", type=float, default=4800.0, help="HBM bandwidth (H200)")
    parser.add_argument("--trace", action="store_true", help="profile the largest TP run")
    parser.add_argument("--no_check", action="store_true", help="skip the correctness part")
    opts = parser.parse_args()
    spec = dict(SMOKE if opts.smoke else FULL)
    for name in ("models", "tp", "slots"):
        value = getattr(opts, name)
        if value:
            items = value.split(",")
            spec[name] = tuple(items if name == "models" else (int(x) for x in items))
    if not opts.smoke and jax.default_backend() != "gpu":
        raise SystemExit("no GPU: run with --smoke for the CPU check")
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    n_dev = len(jax.devices())
    result = dict(
        device=str(jax.devices()[0]),
        devices=n_dev,
        jax=jax.__version__,
        smoke=opts.smoke,
        spec={k: v for k, v in spec.items()},
        hbm_gbps=opts.hbm_gbps,
    )

    def write():
        (out / "gpu_tp.json").write_text(json.dumps(result, indent=1, default=str))

    t0 = time.perf_counter()
    if not opts.no_check:
        result["correctness"] = correctness(spec)
        write()
    result["timing"] = []
    runnable = [t for t in spec["tp"] if t <= n_dev]
    for model in spec["models"]:
        preset, weights = model.split(":")
        c = ModelConfig.preset(preset)
        for t in spec["tp"]:
            base = dict(model=preset, weights=weights, tp=t)
            if t > n_dev:
                rows = [dict(base, slots=b, skipped=f"{n_dev} device(s)") for b in spec["slots"]]
            else:
                trace = None
                if opts.trace and t == max(runnable):
                    trace = out / f"trace_{preset}_{weights}_tp{t}"
                try:
                    rows = time_config(c, weights, t, spec["slots"], spec, opts.hbm_gbps, trace)
                except ValueError as e:  # a TP the model cannot split (the numbers named)
                    rows = [dict(base, slots=b, skipped=str(e)) for b in spec["slots"]]
            for row in rows:
                result["timing"].append(row)
                print(json.dumps(row, default=str))
            write()
    result["seconds"] = time.perf_counter() - t0
    write()
    print(table(result["timing"]))
    failed = [r for r in result.get("correctness", []) if "skipped" not in r and not r["ok"]]
    print(
        f"done in {result['seconds']:.0f} s; {len(failed)} check(s) failed; "
        f"wrote {out / 'gpu_tp.json'}"
    )
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
