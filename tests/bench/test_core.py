"""The benchmark core (`jaxserve/bench/core.py`): steady-state arithmetic on hand-made steps,
percentiles, the workload's sampling params, and the compile counter."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import pytest

from jaxserve.bench import core as bench
from jaxserve.bench.workloads import make_workload


def test_step_summary_steady_state():
    # 4 slots: the last request starts at t=3; steps 0..3 are the saturated phase, 4 the drain.
    occ = [0.25, 1.0, 0.75, 1.0, 0.5]
    live = [0.5, 0.9, None, 1.0, 0.8]
    steps = [
        {"t_s": i, "occupancy": o, "kv_live_share": u} for i, (o, u) in enumerate(zip(occ, live))
    ]
    s = bench.step_summary(steps, num_slots=4, saturated_until_s=3.0)
    assert s["mean_slot_occupancy"] == pytest.approx(0.7)
    assert s["kv_page_utilization"] == pytest.approx((0.5 + 0.9 + 1.0 + 0.8) / 4)
    assert s["kv_live_token_share_steady"] == pytest.approx(0.8)  # steps 0..3, None skipped
    assert s["mean_running_steady"] == pytest.approx(4 * (0.25 + 1.0 + 0.75 + 1.0) / 4)
    assert s["peak_running"] == 4 and s["steady_steps"] == 4


def test_percentiles_and_sampling_params():
    p = bench.percentiles([1.0, 2.0, 3.0, 4.0])
    assert p["p50"] == pytest.approx(2.5) and p["mean"] == pytest.approx(2.5)
    assert bench.percentiles([])["p99"] is None
    w = make_workload("longtail", vocab_size=128, num_requests=3)
    sps = bench.sampling_params_for(w)
    assert [sp.max_tokens for sp in sps] == [r.max_tokens for r in w.requests]
    assert all(sp.ignore_eos and sp.temperature == 0.0 for sp in sps)


def test_compile_counter_counts_backend_compiles():
    c = float(time.time_ns() % 1_000_003)  # a constant no other program of this run has
    f = jax.jit(lambda x: x * c + 1)
    x = jax.block_until_ready(jnp.ones(7))
    with bench.CompileCounter() as first:
        f(x)
    with bench.CompileCounter() as again:
        f(x)  # cached: no compile
    assert first.count == 1 and first.seconds > 0 and again.count == 0


_CACHE_LOAD = """
import jax, jax.numpy as jnp
from jaxserve.bench.core import CompileCounter
f = lambda x: jnp.sin(x) @ x.T + 2
x = jnp.ones((8, 8))
with CompileCounter() as first:
    jax.jit(f)(x)
jax.clear_caches()  # a new process would also miss jit's in-memory cache
with CompileCounter() as again:
    jax.jit(f)(x)
print(first.count, first.loaded, again.count, again.loaded)
"""


def test_compile_counter_counts_persistent_cache_loads(tmp_path):
    """A program read from JAX's persistent compilation cache is built too: counted, and as loaded
    (the suite runs with such a cache: tests/conftest.py)."""
    env = {
        **os.environ,
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    proc = subprocess.run(
        [sys.executable, "-c", _CACHE_LOAD], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["1", "0", "1", "1"]


def test_alternating_medians_rotates_the_order():
    """Every side is called once untimed, then once per round; each round starts one side later,
    so no side always runs right after the same one. The medians are per side, in ms."""
    calls = []

    def side(name):
        return lambda x: calls.append(name) or x

    ms = bench.alternating_medians_ms({n: side(n) for n in "abc"}, jnp.zeros(2), reps=3)
    assert set(ms) == set("abc") and all(v >= 0 for v in ms.values())
    assert calls == [*"abc", *"abc", *"bca", *"cab"]  # untimed, then rounds 0, 1, 2
