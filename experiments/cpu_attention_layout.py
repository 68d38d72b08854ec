"""The CPU attention changes of RESULTS section 36, before vs after, in one process: SmolLM2-135M's
decode forward (`steps.decode_forward`, ragged attention) and prefill step (`steps.prefill`), random
bf16 weights, each variant compiled once and called in turn (ABBA order), median of --reps calls.

    before: the ragged decode's per-page q gather with XLA free to fuse RoPE into it (the
            optimization barrier traced as the identity), prefill chunks through the paged
            reference (`paged_attention_reference`'s einsums)
    after:  the engine as it is (`jaxserve/layers/ragged_attention.py`)

Decode: --slots rows, each with --width pages of 16 tokens (width * 16 - 2 cached tokens).
Prefill: --prefill_rows chunks of 64 tokens starting at --prefill_start, page-table width
--prefill_width. Also prints the largest logit / log-prob difference between the variants.

    .venv/bin/python experiments/cpu_attention_layout.py [--slots 32] [--width 8] [--reps 20]

Name the CPU beside every figure (NOTES.md): these VMs vary between sessions.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

import jaxserve.layers.attention as attention_mod
from jaxserve.bench.core import cpu_name
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.models import llama
from jaxserve.resolve import PrefillShape
from jaxserve.runner import steps
from jaxserve.runner.input_batch import PrefillBatch
from jaxserve.runner.runner import ModelRunner
from pallas_kernels.paged_attention import paged_attention_reference

PS, POOL, CHUNK = 16, 1024, 64


def before():
    """Traces the engine as it was: no barrier before the q gather, the reference for prefill."""
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(jax.lax, "optimization_barrier", lambda x: x))
    stack.enter_context(
        mock.patch.object(attention_mod, "prefill_attention", paged_attention_reference)
    )
    return stack


def runner_for(slots: int, width: int, rows: int) -> ModelRunner:
    c = ModelConfig.preset("smollm2-135m")
    params = jax.jit(lambda k: llama.init_params(c, k, jnp.bfloat16))(jax.random.key(0))
    ec = EngineConfig(
        num_slots=slots, max_model_len=width * PS, page_size=PS, num_pages=POOL,
        dtype="bfloat16", attention_impl="ragged", prefill_chunk_size=CHUNK,
        max_num_batched_tokens=CHUNK * rows,
    )  # fmt: skip
    runner = ModelRunner(params, c, ec, POOL)
    rng = np.random.default_rng(0)
    for slot in range(slots):
        runner._set_pages(slot, rng.choice(POOL, size=width, replace=False).tolist())
        runner._active[slot] = True
    runner._dirty = True
    runner._flush()
    return runner


def alternate(calls: dict, reps: int) -> dict[str, float]:
    """calls: name -> fn() that runs one step and waits; ABBA order; median ms per name."""
    names, ts = list(calls), {n: [] for n in calls}
    for r in range(reps):
        for n in names if r % 2 == 0 else names[::-1]:
            t = time.perf_counter()
            calls[n]()
            ts[n].append(time.perf_counter() - t)
    return {n: float(np.median(v)) * 1e3 for n, v in ts.items()}


def decode_ab(slots: int, width: int, reps: int) -> dict:
    runner = runner_for(slots, width, 1)
    c, ctx = runner.model_config, width * PS - 2
    runner.state = runner.state.replace(
        seq_len=jnp.full((slots,), ctx, jnp.int32),
        max_total_len=jnp.full((slots,), 10**6, jnp.int32),
    )
    shape = runner.resolved.decode_shape(slots - 1, [width] * slots)
    compiled = {}
    for name in ("before", "after"):
        jax.clear_caches()
        with before() if name == "before" else contextlib.nullcontext():
            compiled[name] = steps.decode_forward.lower(
                runner.params, runner.cache, runner.state,
                config=c, impl=runner.resolved.model, shape=shape,
            ).compile()  # fmt: skip
    logits = {}

    def call(name):
        runner.cache, logits[name] = compiled[name](runner.params, runner.cache, runner.state)
        jax.block_until_ready(logits[name])

    for name in compiled:
        call(name)
    diff = float(jnp.abs(logits["after"] - logits["before"]).max())
    ms = alternate({n: lambda n=n: call(n) for n in compiled}, reps)
    return {"step": "decode_forward", "slots": slots, "width": width, "ctx": ctx, "ms": ms,
            "after_over_before": ms["after"] / ms["before"], "max_abs_logit_diff": diff}  # fmt: skip


def prefill_ab(rows: int, width: int, start: int, reps: int) -> dict:
    runner = runner_for(32, width, rows)
    c = runner.model_config
    rng = np.random.default_rng(1)
    batch = PrefillBatch(
        tokens=rng.integers(0, c.vocab_size, (rows, CHUNK)).astype(np.int32),
        slots=np.arange(rows, dtype=np.int32),
        start=np.full((rows,), start, np.int32),
        length=np.full((rows,), CHUNK, np.int32),
        is_last=np.ones((rows,), bool),
        forced=np.full((rows,), -1, np.int32),
        targets=np.full((rows, CHUNK), -1, np.int32),
    )
    shape = PrefillShape(rows, CHUNK, width, False)
    compiled = {}
    for name in ("before", "after"):
        jax.clear_caches()
        with before() if name == "before" else contextlib.nullcontext():
            compiled[name] = steps.prefill.lower(
                runner.params, runner.cache, runner.state, batch, np.bool_(False),
                config=c, impl=runner.resolved.model, shape=shape,
            ).compile()  # fmt: skip
    out = {}

    def call(name):
        runner.cache, runner.state, out[name] = compiled[name](
            runner.params, runner.cache, runner.state, batch, np.bool_(False)
        )
        jax.block_until_ready(out[name].tokens)

    for name in compiled:
        call(name)
    same = bool(np.array_equal(out["after"].tokens, out["before"].tokens))
    diff = float(jnp.abs(out["after"].logprobs - out["before"].logprobs).max())
    ms = alternate({n: lambda n=n: call(n) for n in compiled}, reps)
    return {"step": "prefill", "rows": rows, "width": width, "start": start, "ms": ms,
            "after_over_before": ms["after"] / ms["before"], "same_tokens": same,
            "max_abs_logprob_diff": diff}  # fmt: skip


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--prefill_rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prefill_width", type=int, default=8)
    ap.add_argument("--prefill_start", type=int, default=0)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    print(f"CPU: {cpu_name()}")
    results = [decode_ab(s, a.width, a.reps) for s in a.slots]
    results += [prefill_ab(r, a.prefill_width, a.prefill_start, a.reps) for r in a.prefill_rows]
    for r in results:
        print(json.dumps(r))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpu": cpu_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
