"""What one call of the sampler (`jaxserve.runner.sampling.sample`) costs on this CPU, per setting,
at the decode step's shape [slots, vocab] (SmolLM2: 32 x 49152), f32 logits, no log-probs.

Settings: greedy, temperature 0.7, top-k 50, top-p 0.9 and vLLM-style "filtered" (temperature 0.9,
top-k 20, top-p 0.95, min-p 0.05), each on two logit distributions: "flat" (i.i.d. N(0, 3^2)) and
"zipf" (logit = -1.1 log(rank) + N(0, 0.1^2), a shuffled Zipf law like a language model's).

--baseline_tree DIR also loads DIR/jaxserve/runner/sampling.py (e.g. a `git worktree` of an
earlier commit) and times it in turn with the current one (ABBA order, same inputs).

    .venv/bin/python experiments/sampler_cost.py [--slots 32] [--vocab 49152] [--reps 20] \
        [--baseline_tree /tmp/old]

Name the CPU beside every figure (NOTES.md): these VMs vary between sessions.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.bench.core import cpu_name
from jaxserve.runner import sampling

SETTINGS = {
    "greedy": {},
    "temperature": dict(temperature=0.7),
    "top_k": dict(temperature=0.7, top_k=50),
    "top_p": dict(temperature=0.7, top_p=0.9),
    "filtered": dict(temperature=0.9, top_k=20, top_p=0.95, min_p=0.05),
}


def load_baseline(tree: str):
    """DIR's sampling.py as a module of its own (its pytree registration of SlotRow, which the
    current module already made, is skipped)."""
    src = (Path(tree) / "jaxserve/runner/sampling.py").read_text()
    src = src.replace("jax.tree_util.register_dataclass(", "(lambda *a, **k: None)(", 1)
    path = Path(tempfile.mkdtemp()) / "baseline_sampling.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("baseline_sampling", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def logits_for(kind: str, s: int, v: int) -> jax.Array:
    rng = np.random.default_rng(0)
    if kind == "flat":
        return jnp.asarray(rng.normal(size=(s, v)) * 3, jnp.float32)
    ranks = np.argsort(rng.random((s, v)), axis=-1) + 1  # a shuffled rank per token
    return jnp.asarray(-1.1 * np.log(ranks) + rng.normal(size=(s, v)) * 0.1, jnp.float32)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--baseline_tree", default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    s, v = a.slots, a.vocab
    modules = {"current": sampling}
    if a.baseline_tree:
        modules = {"baseline": load_baseline(a.baseline_tree), **modules}
    fns = {n: jax.jit(m.sample, static_argnums=3) for n, m in modules.items()}
    steps = jnp.zeros((s,), jnp.int32)
    print(f"CPU: {cpu_name()}; sample() at [{s}, {v}], median of {a.reps} calls (ms)")
    rows = []
    for kind in ("zipf", "flat"):
        logits = logits_for(kind, s, v)
        for name, fields in SETTINGS.items():
            state = sampling.init_state(s, v)
            state = state.replace(
                **{k: jnp.full((s,), x, getattr(state, k).dtype) for k, x in fields.items()}
            )
            for f in fns.values():
                jax.block_until_ready(f(logits, state, steps, 20, False))
            ts = {n: [] for n in fns}
            for r in range(a.reps):
                for n in fns if r % 2 == 0 else list(fns)[::-1]:
                    t = time.perf_counter()
                    jax.block_until_ready(fns[n](logits, state, steps, 20, False))
                    ts[n].append(time.perf_counter() - t)
            row = {"logits": kind, "setting": name}
            row.update({n: round(float(np.median(t)) * 1e3, 2) for n, t in ts.items()})
            rows.append(row)
            print(json.dumps(row))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpu": cpu_name(), "slots": s, "vocab": v, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
