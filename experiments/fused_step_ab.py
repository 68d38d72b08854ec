r"""Time one fused decode + prefill step (`runner._mixed`) against the two calls it replaces.

SmolLM2 shapes with random bf16 weights: 31 of 32 slots decode at --ctx cached tokens (ragged
attention) while slot 5 prefills one 64-token chunk, either as `generate` then `prefill` or as one
`_mixed` call. The two alternate (ABAB...) for --reps rounds; prints median and min wall time per
step, and with --profile the XLA CPU time per step summed over threads (jax.profiler trace), which
shows whether a difference comes from less work or from less parallelism.

    .venv/bin/python experiments/fused_step_ab.py [--reps 12] [--profile] [--json PATH]
"""

from __future__ import annotations

import glob
import json
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.layers.ragged_attention import flat_bucket
from jaxserve.models import llama
from jaxserve.runner import runner as runner_lib

_REPS = flags.DEFINE_integer("reps", 12, "Alternating rounds (median / min over them).")
_CTX_PAGES = flags.DEFINE_integer("ctx_pages", 8, "Pages of 16 tokens cached per decoding slot.")
_PROFILE = flags.DEFINE_bool("profile", False, "Also sum XLA CPU op time per step (5 steps).")
_JSON = flags.DEFINE_string("json", None, "Write the results here.")


def xla_cpu_ms(fn, steps: int = 5) -> float:
    """Summed duration of the XLA CPU ops (all threads) per call of fn."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(steps):
                jax.block_until_ready(fn())
        pd = jax.profiler.ProfileData.from_file(glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0])
        ns = 0
        for plane in pd.planes:
            for line in plane.lines:
                if line.name.startswith("tf_XLA"):
                    ns += sum(
                        e.duration_ns
                        for e in line.events
                        if not e.name.startswith("ThunkExecutor") and "Await" not in e.name
                    )
    return ns / steps / 1e6


def main(argv):
    del argv
    c = ModelConfig.preset("smollm2-135m")
    s, ps, pool, w = 32, 16, 4096, _CTX_PAGES.value
    params = jax.jit(lambda k: llama.init_params(c, k, jnp.bfloat16))(jax.random.key(0))
    ec = EngineConfig(
        num_slots=s,
        max_model_len=2048,
        page_size=ps,
        dtype="bfloat16",
        prefill_chunk_size=64,
        max_num_batched_tokens=512,
        fuse_prefill=True,
    )
    runner = runner_lib.ModelRunner(params, c, ec, pool)
    ctx = w * ps - 2
    rng = np.random.default_rng(0)
    for slot in range(s):
        runner.set_pages(slot, rng.choice(pool, size=w, replace=False).tolist())
        runner._active[slot] = slot != 5
    runner._dirty = True
    runner._flush()
    runner.state = runner.state.replace(
        seq_len=jnp.full((s,), ctx, jnp.int32), max_total_len=jnp.full((s,), 10**6, jnp.int32)
    )
    batch = runner_lib.PrefillBatch(
        tokens=np.ones((1, 64), np.int32),
        slots=np.full((1,), 5, np.int32),
        start=np.zeros((1,), np.int32),
        length=np.full((1,), 64, np.int32),
        is_last=np.zeros((1,), bool),
        forced=np.full((1,), -1, np.int32),
        targets=np.full((1, 64), -1, np.int32),
    )
    num_flat = flat_bucket(s * w, runner.max_flat_for(s))

    def reset():  # every call sees the same cached lengths
        runner.state = runner.state.replace(seq_len=jnp.full((s,), ctx, jnp.int32))

    def separate():
        reset()
        dec = runner.generate(runner.max_pages, num_flat, False, s)
        pre = runner.prefill(batch, runner.mixed_width, False)
        return dec[0], pre[0]

    def fused():
        reset()
        dec, _ = runner.mixed(batch, s, runner.max_pages, num_flat)
        return dec[0]

    fns = {"separate": separate, "fused": fused}
    for f in fns.values():  # compile and warm
        jax.block_until_ready(f())
        jax.block_until_ready(f())
    times = {k: [] for k in fns}
    for i in range(_REPS.value):
        for name in list(fns) if i % 2 == 0 else list(fns)[::-1]:
            t = time.perf_counter()
            jax.block_until_ready(fns[name]())
            times[name].append(time.perf_counter() - t)
    result = {}
    for name, ts in times.items():
        result[name] = {"median_ms": 1e3 * float(np.median(ts)), "min_ms": 1e3 * min(ts)}
        if _PROFILE.value:
            result[name]["xla_cpu_ms"] = xla_cpu_ms(fns[name])
    print("| step | median ms | min ms | XLA CPU-ms (all threads) |\n|---|---:|---:|---:|")
    for name, r in result.items():
        cpu = f"{r['xla_cpu_ms']:.1f}" if "xla_cpu_ms" in r else "-"
        print(f"| {name} | {r['median_ms']:.1f} | {r['min_ms']:.1f} | {cpu} |")
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    app.run(main)
