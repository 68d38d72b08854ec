r"""Engine steps of continuous vs static batching, counted by the real host loop without a model.

The engine's scheduler and host loop (`LLMEngine`, `Scheduler`) serve a built-in workload against
`jaxserve/testing/fake_runner.py`'s numpy stand-in for the model, with the engine settings `LLM` uses by
default (64-token prefill chunks, 8 per step, a pool big enough for every slot). The step counts are
the ones a real run makes with those settings, because scheduling never looks at token values: the
workloads serve every request to exactly `max_tokens` with `ignore_eos=True`.

Where a step costs the same whatever its rows and live tokens (the premise of static batching's
waste: a GPU decode step streams the weights however few slots are busy), the output tokens/s ratio
of continuous to static batching equals the ratio of their steps. Where a step's cost grows with
its rows or live tokens (this CPU: RESULTS.md sections 1, 16, 21), the tokens/s ratio is lower (a
continuous step holds more busy rows than a static one, never fewer). So the step ratio is the most
tokens/s this engine's continuous batching (first come, first served) can gain on a workload,
whatever the hardware: a target above it cannot be met on that workload.

    .venv/bin/python experiments/step_counts.py --cases=longtail:256,longtail:1024,longtail-small:128

The engine flags (`jaxserve.launch.flags`) set the engine: --num_slots, --page_size,
--prefill_chunk_size, --max_num_batched_tokens; unset, `EngineConfig`'s defaults (32 slots, pages of
16, 64-token chunks, 8 per step) at max_model_len 2048.

Prints a table; --json writes it. No JAX computation runs (pure host code: both modes of 1,000 requests
take ~30 s).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from absl import app, flags

from jaxserve.bench.core import sampling_params_for
from jaxserve.bench.workloads import make_workload
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.core.engine import LLMEngine
from jaxserve.launch import flags as engine_flags
from jaxserve.testing.fake_runner import FakeRunner

_CASES = flags.DEFINE_list(
    "cases",
    ["longtail:256", "longtail:1024", "longtail-small:128"],
    "workload:num_requests pairs to count.",
)
_SEED = flags.DEFINE_integer("workload_seed", 0, "Workload seed (the benchmarks use 0).")
_JSON = flags.DEFINE_string("json", None, "Write the table here as JSON.")

MAX_MODEL_LEN = 2048  # what LLM picks for SmolLM2 and the benchmark's synthetic Llama
VOCAB = 49152  # SmolLM2's vocabulary (only the prompts' token values depend on it)


MODEL = dataclasses.replace(ModelConfig.preset("tiny"), max_position_embeddings=MAX_MODEL_LEN)


def settings(batching: str = "continuous") -> EngineConfig:
    """The engine flags that were set, at MAX_MODEL_LEN, with a pool for every slot at it."""
    ec = dataclasses.replace(
        engine_flags.engine_config(), max_model_len=MAX_MODEL_LEN, batching=batching
    ).for_model(MODEL)
    return dataclasses.replace(ec, num_pages=ec.num_slots * ec.max_pages_per_seq)


def count_steps(workload, batching: str) -> dict:
    """Serves `workload` through the real host loop; returns its step and token counts."""
    ec = settings(batching)
    num_slots, num_pages, page_size, chunk = (
        ec.num_slots, ec.num_pages, ec.page_size, ec.prefill_chunk_size
    )  # fmt: skip
    rows = ec.max_num_batched_tokens // chunk
    mc = dataclasses.replace(MODEL, vocab_size=workload.vocab_size)
    runner = FakeRunner(
        num_slots, num_pages, page_size, rows=rows, chunk=chunk,
        slot_buckets=(num_slots,),
    )  # fmt: skip
    engine = LLMEngine(runner, mc, ec, num_pages, tokenizer=None, seed=0)
    params = sampling_params_for(workload)
    for r, sp in zip(workload.requests, params):
        engine.add_request(engine.next_request_id(), None, list(r.prompt_token_ids), sp)
    tokens = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
    stats = engine.stats()
    return {
        "steps": stats["num_steps"],
        "output_tokens": tokens,
        "decode_steps": len(runner.decode_rows),
        "mean_slot_occupancy": stats.get("mean_slot_occupancy"),
    }


def main(argv):
    del argv
    rows = []
    ec = settings()
    num_slots, page_size, chunk = ec.num_slots, ec.page_size, ec.prefill_chunk_size
    prefill_rows = ec.max_num_batched_tokens // chunk
    print(
        f"{num_slots} slots, page_size {page_size}, prefill chunks of {chunk} tokens, "
        f"{prefill_rows} per step"
    )
    print(
        "| workload | requests | output tokens | ideal steps | continuous | static | static / continuous |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for case in _CASES.value:
        name, n = case.split(":")
        workload = make_workload(name, vocab_size=VOCAB, num_requests=int(n), seed=_SEED.value)
        cont, stat = (count_steps(workload, b) for b in ("continuous", "static"))
        if cont["output_tokens"] != stat["output_tokens"]:
            raise RuntimeError(f"{case}: the two modes made different numbers of tokens")
        ideal = -(-cont["output_tokens"] // num_slots)
        ratio = stat["steps"] / cont["steps"]
        rows.append(
            {"workload": name, "num_requests": int(n), "ideal_steps": ideal,
             "continuous": cont, "static": stat, "step_ratio": ratio}
        )  # fmt: skip
        print(
            f"| {name} | {n} | {cont['output_tokens']:,} | {ideal:,} | {cont['steps']:,} | "
            f"{stat['steps']:,} | {ratio:.2f}x |",
            flush=True,
        )
    if _JSON.value:
        Path(_JSON.value).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    app.run(main)
