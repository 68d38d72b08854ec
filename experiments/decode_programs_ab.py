"""Decode as one program per step (`steps.generate`) or as two (`decode_forward` then
`decode_sample`, the default on one device since section 29, for the structured-output overlap):
which is faster on this CPU? SmolLM2-135M-Instruct bf16, one engine, both modes timed in turn.

    PYTHONPATH=<checkout> .venv/bin/python experiments/decode_programs_ab.py --out OUT.jsonl

One `LLM` is built and warmed up; each round generates `--max_tokens` greedy tokens (ignore_eos)
for `--batch` short prompts, once with `runner.overlaps_grammar` off (one program) and once on
(two), in ABBA order, so both modes see the same engine, weights, cache and machine drift. The
first round of each mode compiles its programs and is not counted. No request is constrained, so
the two-program mode never defers a step; the sampled tokens of the two modes must be the same
(checked). Prints and appends per batch size the median seconds per round of each mode and the
median of the per-pair ratios one/two.
"""

from __future__ import annotations

import logging
import statistics
import time

from absl import app, flags

from jaxserve import LLM, SamplingParams
from jaxserve.bench.core import append_row_jsonl, cpu_name

_BATCHES = flags.DEFINE_list("batches", ["1", "8", "32"], "Prompts per round.")
_TOKENS = flags.DEFINE_integer("max_tokens", 64, "Tokens generated per prompt.")
_PAIRS = flags.DEFINE_integer("pairs", 6, "Counted ABBA pairs per batch size.")
_OUT = flags.DEFINE_string("out", None, "Append one JSON line per batch size here.")


def run_round(llm: LLM, prompts: list[str], sp: SamplingParams, two_programs: bool):
    llm.engine.runner.overlaps_grammar = two_programs
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    return dt, [o.outputs[0].token_ids for o in outs]


def measure(llm: LLM, batch: int) -> dict:
    prompts = [f"Write a short story about the number {i}." for i in range(batch)]
    sp = SamplingParams(temperature=0, max_tokens=_TOKENS.value, ignore_eos=True)
    ref = run_round(llm, prompts, sp, False)[1]  # compiles the one-program decode shapes used
    assert run_round(llm, prompts, sp, True)[1] == ref, "the two modes sampled different tokens"
    one, two, ratios = [], [], []
    for i in range(_PAIRS.value):
        order = (False, True) if i % 2 == 0 else (True, False)
        times = {}
        for mode in order:
            dt, toks = run_round(llm, prompts, sp, mode)
            assert toks == ref, "the two modes sampled different tokens"
            times[mode] = dt
        one.append(times[False])
        two.append(times[True])
        ratios.append(times[False] / times[True])
    return {
        "batch": batch,
        "max_tokens": _TOKENS.value,
        "pairs": _PAIRS.value,
        "one_program_s": round(statistics.median(one), 4),
        "two_programs_s": round(statistics.median(two), 4),
        "ratio_one_over_two_median": round(statistics.median(ratios), 4),
        "ratio_min": round(min(ratios), 4),
        "ratio_max": round(max(ratios), 4),
        "one_program_tok_s": round(batch * _TOKENS.value / statistics.median(one), 1),
        "two_programs_tok_s": round(batch * _TOKENS.value / statistics.median(two), 1),
        "cpu": cpu_name(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def main(_):
    logging.getLogger("jax").setLevel(logging.WARNING)
    llm = LLM(dtype="bfloat16", num_slots=32)
    llm.warmup()
    for b in _BATCHES.value:
        row = measure(llm, int(b))
        append_row_jsonl(_OUT.value, row)


if __name__ == "__main__":
    app.run(main)
