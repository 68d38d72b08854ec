r"""Time the engine's jitted step functions on SmolLM2 shapes, per page-table width and pool size.

Random bf16 weights at the smollm2-135m preset, `ModelRunner` as the engine builds it; every slot
active with `ctx` cached tokens (so the attention really reads ctx tokens per slot). For each
(attention impl, pool pages, width) it times `generate` (one decode step of all slots) and, per
prefill row bucket, `prefill` (R chunks of 64 tokens). Median of --reps calls, in one process.
'reference' decodes at page-table width W (cost ~ slots x W); 'ragged' over the slots' live pages.

    .venv/bin/python experiments/engine_step_profile.py --pools=1024,4096 --widths=8,64

--op_profile also traces 5 decode steps (`jax.profiler`) and breaks their XLA CPU time (summed over
threads) down by the JAX op each XLA op came from, read from the compiled program's metadata.
"""

from __future__ import annotations

import collections
import glob
import json
import re
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.models import llama
from jaxserve.resolve import PrefillShape
from jaxserve.runner import steps
from jaxserve.runner.input_batch import PrefillBatch
from jaxserve.runner.runner import ModelRunner

_POOLS = flags.DEFINE_list("pools", ["1024", "4096"], "KV pool sizes (pages) to time.")
_WIDTHS = flags.DEFINE_list("widths", ["8", "64"], "Page-table width buckets to time.")
_ROWS = flags.DEFINE_list("rows", ["1", "8"], "Prefill row buckets to time.")
_CHUNKS = flags.DEFINE_list("chunks", ["64"], "Prefill chunk lengths (tokens per row) to time.")
_SLOTS = flags.DEFINE_integer("num_slots", 32, "Slots.")
_DECODE_ROWS = flags.DEFINE_list(
    "decode_rows", [], "Also time a decode step of each of these slot row buckets (all busy)."
)
_REPS = flags.DEFINE_integer("reps", 5, "Timed calls per point (median).")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "Weights / activations dtype.")
_IMPLS = flags.DEFINE_list("impls", ["reference", "ragged"], "Attention implementations to time.")
_MATMULS = flags.DEFINE_list("matmul_impls", ["auto"], "Dense matmul implementations to time.")
_JSON = flags.DEFINE_string("json", None, "Write the results here.")
_OP_PROFILE = flags.DEFINE_bool(
    "op_profile",
    False,
    "Also break the decode step's XLA CPU time down by the JAX op each XLA op came from.",
)


def timed(fn, reps):
    out = fn()
    jax.block_until_ready(out)  # compile
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def op_categories(compiled_text: str) -> dict[str, str]:
    """XLA op name -> the JAX op it came from (the last two parts of its metadata op_name, e.g.
    'ni,io->no/dot_general' for a weight matmul, 'jit(dynamic_index_in_dim)/dynamic_slice')."""
    out = {}
    for m in re.finditer(r'%([\w.-]+) = .*?metadata=\{op_name="([^"]+)"', compiled_text):
        out[m.group(1)] = "/".join(m.group(2).split("/")[-2:])
    # a custom call (the C++ CPU kernels) by its target and result shape
    for m in re.finditer(
        r'%([\w.-]+) = (\(.*?\)|\S+) custom-call\(.*?custom_call_target="([^"]+)"', compiled_text
    ):  # the result: one shape, or a tuple of them (matmul_many)
        out[m.group(1)] = f"{m.group(3)} {m.group(2)}"
    return out


def op_profile(fn, compiled_text: str, calls: int = 5) -> dict[str, float]:
    """XLA CPU time per call of fn (ms, summed over threads), by JAX op (`op_categories`)."""
    names = op_categories(compiled_text)
    ms = collections.Counter()
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(calls):
                jax.block_until_ready(fn())
        pd = jax.profiler.ProfileData.from_file(glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0])
        for plane in pd.planes:
            for line in plane.lines:
                if not line.name.startswith("tf_XLA"):
                    continue
                for e in line.events:
                    if e.name.startswith(("ThunkExecutor", "ThreadpoolListener", "end: ")):
                        continue  # containers and markers, not work
                    if "Await" in e.name:
                        continue  # waits
                    ms[names.get(e.name, e.name)] += e.duration_ns / 1e6 / calls
    return dict(ms.most_common())


def main(argv):
    del argv
    c = ModelConfig.preset("smollm2-135m")
    s, ps = _SLOTS.value, 16
    params = jax.jit(lambda k: llama.init_params(c, k, jnp.dtype(_DTYPE.value)))(jax.random.key(0))
    results = []
    points = [(i, mi, int(p)) for p in _POOLS.value for i in _IMPLS.value for mi in _MATMULS.value]
    for impl, matmul_impl, pool in points:
        widths = [int(w) for w in _WIDTHS.value]
        ec = EngineConfig(
            num_slots=s,
            max_model_len=max(widths) * ps,
            page_size=ps,
            num_pages=pool,
            dtype=_DTYPE.value,
            attention_impl=impl,
            matmul_impl=matmul_impl,
            prefill_chunk_size=64,
            max_num_batched_tokens=64 * max(int(r) for r in _ROWS.value),
        )
        runner = ModelRunner(params, c, ec, pool)
        for w in widths:
            ctx = w * ps - 2
            rng = np.random.default_rng(0)
            for slot in range(s):
                pages = rng.choice(pool, size=w, replace=False).tolist()
                runner._set_pages(slot, pages)
                runner._active[slot] = True
            runner._dirty = True
            runner._flush()
            runner.state = runner.state.replace(
                seq_len=jnp.full((s,), ctx, jnp.int32),
                max_total_len=jnp.full((s,), 10**6, jnp.int32),
            )

            # as a decode step over all s slots of w pages each (`Resolved.decode_shape`)
            shape = runner.resolved.decode_shape(s - 1, [w] * s)

            def gen(shape=shape, runner=runner, ctx=ctx):
                # seq_len grows each call; reset so every rep sees the same ctx
                runner.state = runner.state.replace(seq_len=jnp.full((s,), ctx, jnp.int32))
                return runner.generate(shape).tokens

            row = {"impl": impl, "matmul": matmul_impl, "pool_pages": pool, "width": w, "ctx": ctx}
            row["num_flat"] = shape.num_flat
            row["generate_ms"] = timed(gen, _REPS.value) * 1e3
            for b in map(int, _DECODE_ROWS.value):  # the first b slots, as a step of b rows
                part = runner.resolved.decode_shape(b - 1, [w] * b)
                assert part.rows == b, f"{b} is not a slot bucket: {runner.resolved.slot_buckets}"
                row[f"generate_r{b}_ms"] = timed(lambda p=part: gen(p), _REPS.value) * 1e3
            if _OP_PROFILE.value:
                # the runner's decode step: one program, or (overlaps_grammar, one device and
                # one decode step per round trip) the forward then the sampler, named from the
                # forward's program (its ops are most of the step's time)
                common = dict(config=c, impl=runner.resolved.model, shape=shape)
                if runner.overlaps_grammar:
                    lowered = steps.decode_forward.lower(
                        runner.params, runner.cache, runner.state, **common
                    )
                else:
                    lowered = steps.generate.lower(
                        runner.params, runner.cache, runner.state, np.bool_(False),
                        num_steps=ec.decode_steps, **common,
                    )  # fmt: skip
                ops = op_profile(gen, lowered.compile().as_text())
                total = sum(ops.values())
                row["generate_xla_cpu_ms"] = total
                row["generate_ops_cpu_ms"] = {k: round(v, 2) for k, v in ops.items() if v >= 0.1}
                print(
                    f"decode step, {impl}, matmul {matmul_impl}, width {w}: "
                    f"XLA CPU time {total:.1f} ms per step"
                )
                for k, v in list(ops.items())[:25]:
                    print(f"  {v:7.2f} ms  {100 * v / total:4.1f}%  {k}")
            for r, t in [(int(r), int(t)) for r in _ROWS.value for t in _CHUNKS.value]:
                batch = PrefillBatch(
                    tokens=np.ones((r, t), np.int32),
                    slots=np.arange(r, dtype=np.int32),
                    start=np.full((r,), max(ctx - t, 0) // ps * ps, np.int32),
                    length=np.full((r,), t, np.int32),
                    is_last=np.zeros((r,), bool),
                    forced=np.full((r,), -1, np.int32),
                    targets=np.full((r, t), -1, np.int32),
                )
                key = f"prefill_r{r}_ms" if t == 64 else f"prefill_r{r}_t{t}_ms"
                row[key] = (
                    timed(
                        lambda b=batch, w=w, runner=runner: (
                            runner.prefill(b, PrefillShape(*b.tokens.shape, w, False)).tokens
                        ),
                        _REPS.value,
                    )
                    * 1e3
                )
            print(
                json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()})
            )
            results.append(row)
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    app.run(main)
