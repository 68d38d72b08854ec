"""The engine end to end on a GPU: greedy tokens with the Pallas kernels vs the jnp reference
attention, per weight / KV format, and decode throughput.

    python experiments/gpu_engine_check.py [--out DIR] [--budget_s S]    # on the H200
    .venv/bin/python experiments/gpu_engine_check.py --smoke             # the script itself, CPU

SmolLM2-135M shapes with random weights (`load_format="dummy"`: the real GGUF is over the device
tool's carry limit), token-id prompts, so no tokenizer. For each case two `LLM`s differ only in
`attention_impl` ("pallas", what "auto" picks on a GPU, vs "reference", the jnp gather reference
of every kernel): the greedy tokens of 16 prompts x 32 tokens and the chosen tokens' log-probs
up to the first position where the two disagree (random weights give near ties, so an early
disagreement is a lead to read, not by itself a failure; the log-prob gap before it is the
number). Then the Pallas engine's throughput: 256 requests of 128 prompt and 128 output tokens
over 64 slots, the first run compiling, the second timed. Writes gpu_engine_check.json under
--out after every case, so a run stopped at its limit keeps what it finished.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

import jax
import numpy as np

from jaxserve import LLM, SamplingParams

CASES = [  # name, LLM settings besides attention_impl
    ("bf16", dict(dtype="bfloat16")),
    ("bf16_int8kv", dict(dtype="bfloat16", kv_cache_dtype="int8")),
    ("bf16_fp8kv", dict(dtype="bfloat16", kv_cache_dtype="fp8")),
    ("int4_rtn", dict(dtype="bfloat16", quantization="int4-rtn")),
]


def prompts(n, lo, hi, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {"prompt_token_ids": rng.integers(3, vocab, rng.integers(lo, hi + 1)).tolist()}
        for _ in range(n)
    ]


def greedy(llm, ps, max_tokens):
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    outs = llm.generate(ps, sp, use_tqdm=False)
    bad = [o.outputs[0].finish_reason for o in outs if o.outputs[0].finish_reason != "length"]
    if bad:
        raise RuntimeError(f"requests ended {bad}")
    toks = [o.outputs[0].token_ids for o in outs]
    lps = [
        [d[t].logprob for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)]
        for o in outs
    ]
    return toks, lps


def compare(a, b):
    (ta, la), (tb, lb) = a, b
    first, gaps, same = [], [], 0
    for xa, xb, ya, yb in zip(ta, tb, la, lb, strict=True):
        n = next((i for i, (p, q) in enumerate(zip(xa, xb, strict=True)) if p != q), len(xa))
        first.append(n)
        same += n == len(xa)
        if n:
            gaps.append(float(np.max(np.abs(np.array(ya[:n]) - np.array(yb[:n])))))
    return {
        "rows_identical": same,
        "rows": len(ta),
        "first_disagreement_median": float(np.median(first)),
        "first_disagreement_min": int(min(first)),
        "max_logprob_gap_before_disagreement": max(gaps) if gaps else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or "experiments/out/gpu_engine")
    parser.add_argument("--smoke", action="store_true", help="tiny model, few tokens, CPU")
    parser.add_argument("--budget_s", type=float, default=300.0, help="start no case after this")
    opts = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not opts.smoke:
        parser.error("no GPU: run with --smoke")
    deadline = time.monotonic() + opts.budget_s
    model = "tiny" if opts.smoke else "smollm2-135m"
    pallas = "pallas" if on_gpu else "pallas_interpret"
    n, steps = (4, 6) if opts.smoke else (16, 32)
    base = dict(load_format="dummy", max_model_len=512, num_slots=8 if opts.smoke else 16)
    if opts.smoke:
        base["max_model_len"] = 64
    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "cases": []}
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)

    def write():
        (out / "gpu_engine_check.json").write_text(json.dumps(res, indent=1))

    vocab = 128 if opts.smoke else 49152
    ps = prompts(n, 5, 40 if opts.smoke else 300, vocab)
    for name, kw in CASES:
        if time.monotonic() > deadline:
            res["cases"].append({"case": name, "skipped": "budget"})
            continue
        row = {"case": name}
        runs = {}
        for impl in (pallas, "reference"):
            t0 = time.perf_counter()
            llm = LLM(model, attention_impl=impl, **base, **kw)
            runs[impl] = greedy(llm, ps, steps)
            row[f"{impl}_s"] = round(time.perf_counter() - t0, 1)
            del llm
            jax.clear_caches()
        row |= compare(runs[pallas], runs["reference"])
        print(json.dumps(row), flush=True)
        res["cases"].append(row)
        write()

    if time.monotonic() < deadline:
        slots, n_req, length = (8, 16, 16) if opts.smoke else (64, 256, 128)
        kw = dict(load_format="dummy", max_model_len=2 * length + 8, num_slots=slots)
        llm = LLM(model, attention_impl=pallas, dtype="bfloat16", **kw)
        ps = prompts(n_req, length, length, vocab, seed=1)
        sp = SamplingParams(temperature=0, max_tokens=length, ignore_eos=True)
        runs = []
        for _ in range(2):
            t0 = time.perf_counter()
            llm.generate(ps, sp, use_tqdm=False)
            runs.append(time.perf_counter() - t0)
        res["throughput"] = {
            "slots": slots,
            "requests": n_req,
            "prompt_tokens": length,
            "output_tokens": length,
            "first_run_s": round(runs[0], 2),
            "timed_run_s": round(runs[1], 2),
            "output_tok_s": round(n_req * length / runs[1], 1),
        }
        print(json.dumps(res["throughput"]), flush=True)
        write()
    write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
