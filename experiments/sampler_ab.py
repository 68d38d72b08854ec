"""The sampler (`jaxserve.runner.sampling.sample`) of this tree against the one of a git revision,
in one process: [rows, vocab] f32 logits, every slot greedy and plain (the commonest decode
step), without and with log-probs. The two sides alternate (`alternating_medians_ms`) and must
pick the same tokens; each side's minor page faults per call are counted too (`getrusage`: XLA
allocates a program's temporaries per call, so [S, V] copies into them touch fresh pages).

    .venv/bin/python experiments/sampler_ab.py --baseline REV [--rows 32] [--reps 41]

REV's `sample` function is taken from its `jaxserve/runner/sampling.py` and run over this tree's
helpers, so REV must share them (the A/B of a change to `sample` itself).
Name the CPU beside every figure (shared/NOTES.md): these VMs vary between sessions.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.bench.core import alternating_medians_ms, cpu_name
from jaxserve.runner import sampling


def sample_at(rev: str):
    """`sample` as written at git revision `rev`, over this tree's sampling module."""
    src = subprocess.run(
        ["git", "show", f"{rev}:jaxserve/runner/sampling.py"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    src = src[src.index("def sample(") : src.index("def _sample_from(")]
    scope = dict(vars(sampling))
    exec(src, scope)
    return scope["sample"]


def faults_per_call(fn, args, calls: int = 20) -> float:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(calls):
        jax.block_until_ready(fn(*args))
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True, help="a git revision: its `sample` as side B")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--reps", type=int, default=41)
    a = ap.parse_args()
    print(f"CPU: {cpu_name()}")
    impls = {"now": sampling.sample, "baseline": sample_at(a.baseline)}
    logits = jax.random.normal(jax.random.key(0), (a.rows, a.vocab), jnp.float32)
    state = sampling.init_state(a.rows, a.vocab)
    generated = jnp.zeros((a.rows,), jnp.int32)
    args = (logits, state, generated)
    for want_top in (False, True):
        fns = {
            side: jax.jit(lambda x, s, g, f=f, w=want_top: f(x, s, g, 20, w))
            for side, f in impls.items()
        }
        tokens = {side: np.asarray(f(*args).tokens) for side, f in fns.items()}
        ms = alternating_medians_ms(fns, *args, reps=a.reps)
        row = {"rows": a.rows, "vocab": a.vocab, "logprobs": want_top,
               "now_ms": round(ms["now"], 2), "baseline_ms": round(ms["baseline"], 2),
               "now_over_baseline": round(ms["now"] / ms["baseline"], 3),
               "same_tokens": bool((tokens["now"] == tokens["baseline"]).all())}  # fmt: skip
        for side, f in fns.items():
            row[f"{side}_page_faults_per_call"] = round(faults_per_call(f, args))
        print(json.dumps(row))


if __name__ == "__main__":
    main()
