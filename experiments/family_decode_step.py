r"""Decode step time per model family at real shapes on CPU, and a sliding window's decode cost
(issue 26).

Families: for each preset (real vocabulary, hidden size, heads, MLP / experts), one decode step of
the engine's own `ModelRunner` (the CPU default: 'ragged' attention, weights [out, in]) with every
slot active and `--ctx` tokens cached, bf16 dummy weights, at 8 and 32 slots. The weights of a
whole 8B-47B model do not fit this VM's 23 GB, so each preset is timed at --layers_lo and
--layers_hi layers (default 3 and 7) and the full model's step is extrapolated linearly:
per layer = (t(hi) - t(lo)) / (hi - lo), full = t(lo) + (L - lo) * per layer (the embedding,
final norm and lm_head are in t(lo); every decoder layer of a family costs the same at a context
inside its windows). Fewer than 3 layers are not used: XLA compiles a layer scan of 1 or 2 steps
differently (at 32 slots Llama-3-8B's 2-layer step took longer than its 3-layer one, twice). The
15th and 16th sessions timed 3 and 4 layers: a one-layer difference was within this VM's noise.
The MoE presets' layers are 1.2-2.8 GB each: time them with experiments/moe_decode_step.py.
Median of --reps after two untimed calls, variants timed in one process.

Window: the same layers (Mistral-7B's shapes, --window_layers layers) at a 4k context, every layer
global vs every layer sliding with a 1k window: the ragged decode then gathers only the window's
pages (`steps._window_flat`), so its attention cost follows the window, not the context.

    .venv/bin/python experiments/family_decode_step.py [--reps 3] [--json out.json]

Name the CPU beside every figure (NOTES.md): these VMs vary between sessions.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from jaxserve.bench.core import cpu_name
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.loading.dummy import dummy_params
from jaxserve.runner.runner import ModelRunner

FAMILIES = ["llama3-8b", "qwen3-8b", "gemma2-9b", "gemma3-12b", "phi3-mini"]
_FAMILIES = flags.DEFINE_list("families", FAMILIES, "Presets to time.")
_SLOTS = flags.DEFINE_list("slots", ["8", "32"], "Slot counts (every slot decoding).")
_CTX = flags.DEFINE_integer("ctx", 512, "Cached tokens per slot in the family table.")
_REPS = flags.DEFINE_integer("reps", 3, "Timed calls per point (median).")
_LO = flags.DEFINE_integer("layers_lo", 3, "Fewer layers of the two timed per preset (>= 3).")
_HI = flags.DEFINE_integer("layers_hi", 7, "More layers of the two timed per preset.")
_WINDOW_CTX = flags.DEFINE_integer("window_ctx", 4096, "Context of the window comparison.")
_WINDOW = flags.DEFINE_integer("window", 1024, "Sliding window of the window comparison.")
_WINDOW_LAYERS = flags.DEFINE_integer("window_layers", 4, "Layers in the window comparison.")
_SKIP_WINDOW = flags.DEFINE_bool("skip_window", False, "Only the family table.")
_JSON = flags.DEFINE_string("json", None, "Write the results here.")
PS = 16


def with_layers(c: ModelConfig, n: int) -> ModelConfig:
    """`c` cut to its first n layers (per-layer patterns cut with it)."""
    changes = {"num_layers": n}
    if c.layer_types:
        changes["layer_types"] = tuple(c.layer_types[:n])
    if getattr(c, "mlp_only_layers", None):
        changes["mlp_only_layers"] = tuple(i for i in c.mlp_only_layers if i < n)
    return dataclasses.replace(c, **changes)


def step_ms(c: ModelConfig, slots: int, ctx: int, reps: int) -> float:
    """Median ms of one decode step of all `slots` slots, `ctx` tokens cached in each (the
    engine's buffers and compiled programs are dropped afterwards: without that, the 2026-12-01
    run grew to 24 GB and was OOM-killed at gemma3-12b)."""
    try:
        return _step_ms(c, slots, ctx, reps)
    finally:
        gc.collect()
        jax.clear_caches()


def _step_ms(c: ModelConfig, slots: int, ctx: int, reps: int) -> float:
    width = -(-(ctx + 2) // PS)
    pool = slots * width
    ec = EngineConfig(
        num_slots=slots,
        max_model_len=width * PS,
        page_size=PS,
        num_pages=pool,
        dtype="bfloat16",
        prefill_chunk_size=64,
    ).for_model(c)
    runner = ModelRunner(dummy_params(c, "bfloat16"), c, ec, pool)
    for slot in range(slots):
        runner._set_pages(slot, list(range(slot * width, (slot + 1) * width)))
        runner._active[slot] = True
    runner._dirty = True
    runner._flush()
    shape = runner.resolved.decode_shape(slots - 1, [width] * slots)

    def gen():
        runner.state = runner.state.replace(
            seq_len=jnp.full((slots,), ctx, jnp.int32),
            max_total_len=jnp.full((slots,), 10**6, jnp.int32),
        )
        return runner.generate(shape).tokens

    for _ in range(2):  # compile, then one more: first touches of the fresh weights and pool
        jax.block_until_ready(gen())
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(gen())
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1e3


def families(reps: int) -> list[dict]:
    rows = []
    for name in _FAMILIES.value:
        full = ModelConfig.preset(name)
        lo, hi = _LO.value, _HI.value
        for s in map(int, _SLOTS.value):
            t_lo = step_ms(with_layers(full, lo), s, _CTX.value, reps)
            t_hi = step_ms(with_layers(full, hi), s, _CTX.value, reps)
            per_layer = (t_hi - t_lo) / (hi - lo)
            row = {
                "family": name,
                "slots": s,
                "ctx": _CTX.value,
                "layers": full.num_layers,
                f"step_{lo}_layers_ms": round(t_lo, 1),
                f"step_{hi}_layers_ms": round(t_hi, 1),
                "per_layer_ms": round(per_layer, 1),
                "full_model_step_ms": round(t_lo + (full.num_layers - lo) * per_layer, 1),
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def window(reps: int) -> list[dict]:
    base = ModelConfig.preset("llama3-8b")  # Mistral-7B's layer shapes: 4096, 14336, 32/8 x 128
    base = dataclasses.replace(base, vocab_size=32000, num_layers=_WINDOW_LAYERS.value)
    rows = []
    for s in map(int, _SLOTS.value):
        row = {"slots": s, "ctx": _WINDOW_CTX.value, "layers": _WINDOW_LAYERS.value}
        for label, w in (("global_ms", None), ("window_ms", _WINDOW.value)):
            row[label] = round(
                step_ms(dataclasses.replace(base, sliding_window=w), s, _WINDOW_CTX.value, reps), 1
            )
        row["window"] = _WINDOW.value
        row["window_over_global"] = round(row["window_ms"] / row["global_ms"], 3)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main(argv):
    del argv
    if not 3 <= _LO.value < _HI.value:
        raise app.UsageError("need 3 <= --layers_lo < --layers_hi")
    out = {
        "machine": cpu_name(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "families": families(_REPS.value),
    }
    if not _SKIP_WINDOW.value:
        out["window"] = window(_REPS.value)
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    app.run(main)
