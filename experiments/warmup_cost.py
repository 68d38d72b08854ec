"""What the engine's warm-up compiles, and how long it takes: SmolLM2-135M-Instruct bf16 on this
machine, one `LLM(..., warmup=True)` per attention implementation.

    PYTHONPATH=<checkout> .venv/bin/python experiments/warmup_cost.py --out OUT.json

For each `--attention_impls` entry: the decode and prefill shapes the engine warms up
(`Resolved.decode_shapes` / `prefill_shapes`), the XLA backend compilations during `llm.warmup()`
and their seconds (`CompileCounter`), and warm-up's wall time. On CPU 'auto' is the C++ kernel
(one page-table width); 'ragged' has a width bucket per power of two, as a GPU engine does, so it
shows what a per-width program costs. Run it from two checkouts (PYTHONPATH) to compare them; it
uses only APIs both sides of a change have.
"""

from __future__ import annotations

import logging
import time

import jax
from absl import app, flags

from jaxserve import LLM
from jaxserve.bench.core import CompileCounter, append_row_jsonl, cpu_name

_IMPLS = flags.DEFINE_list(
    "attention_impls", ["auto", "ragged"], "attention_impl values to warm up."
)
_SLOTS = flags.DEFINE_integer("num_slots", 32, "Engine slots.")
_OUT = flags.DEFINE_string("out", None, "Append one JSON line per engine here.")
_MODEL = flags.DEFINE_string("model", None, "Model (default: SmolLM2-135M-Instruct's GGUF).")
_LOAD_FORMAT = flags.DEFINE_string(
    "load_format", None, "'dummy': random weights of the model's shapes (no files needed)."
)


def measure(impl: str) -> dict:
    kwargs = {k: v for k, v in [("model", _MODEL.value), ("load_format", _LOAD_FORMAT.value)] if v}
    llm = LLM(dtype="bfloat16", num_slots=_SLOTS.value, attention_impl=impl, **kwargs)
    r = llm.engine.runner.resolved
    with CompileCounter() as cc:
        t0 = time.perf_counter()
        llm.warmup()
        wall = time.perf_counter() - t0
    return {
        "attention_impl": impl,
        "model": _MODEL.value or "default",
        "load_format": _LOAD_FORMAT.value or "auto",
        "resolved_attention": r.model.attention,
        "decode_shapes": len(r.decode_shapes()),
        "prefill_shapes": len(r.prefill_shapes()),
        "compiles": cc.count - cc.loaded,
        "cache_loads": cc.loaded,
        "compile_s": round(cc.seconds, 2),
        "warmup_s": round(wall, 2),
        "cpu": cpu_name(),
        "device": jax.devices()[0].device_kind,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def main(_):
    logging.getLogger("jax").setLevel(logging.WARNING)
    for impl in _IMPLS.value:
        res = measure(impl)
        append_row_jsonl(_OUT.value, res)


if __name__ == "__main__":
    app.run(main)
