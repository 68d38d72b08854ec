"""Prompt-lookup speculative decoding on and off, side by side in one process: the same greedy
requests through two `LLM`s (SmolLM2 bf16), every output compared token for token, and the
offline time, steps and accepted drafts of each.

    .venv/bin/python experiments/spec_decode_ab.py [--workload longtail-small] \
        [--num_requests 48] [--k 3] [--max_n 4] [--min_n 1] [--disable_by_batch_size N] \
        [--per_batch_size "[[1, 8, 3], [9, 32, 1]]"] [--reps 3] [--num_slots 32]

The engines alternate (off, on, off, on, ...) --reps times; the medians are printed. With
--num_slots 1 the requests run one at a time (the latency of a lone request).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from jaxserve import LLM
from jaxserve.bench.core import cpu_name, prompts_for, sampling_params_for
from jaxserve.bench.workloads import make_workload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="longtail-small")
    ap.add_argument("--num_requests", type=int, default=48)
    ap.add_argument("--vocab_size", type=int, default=49152)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max_n", type=int, default=4)
    ap.add_argument("--min_n", type=int, default=1)
    ap.add_argument("--disable_by_batch_size", type=int, default=None)
    ap.add_argument("--per_batch_size", default=None,
                    help="num_speculative_tokens_per_batch_size, JSON: [[1, 8, 3], [9, 32, 1]]")  # fmt: skip
    ap.add_argument("--num_slots", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args()
    workload = make_workload(a.workload, a.vocab_size, a.num_requests, a.seed)
    prompts, params = prompts_for(workload), sampling_params_for(workload)
    common = dict(dtype=a.dtype, num_slots=a.num_slots, warmup=True)
    engines = {
        "off": LLM(**common),
        "on": LLM(
            **common,
            num_speculative_tokens=a.k,
            prompt_lookup_max=a.max_n,
            prompt_lookup_min=a.min_n,
            speculative_disable_by_batch_size=a.disable_by_batch_size,
            num_speculative_tokens_per_batch_size=a.per_batch_size,
        ),
    }
    times = {name: [] for name in engines}
    outs = {}
    for _ in range(a.reps):
        for name, llm in engines.items():
            before = llm.engine.stats()
            t0 = time.perf_counter()
            res = llm.generate(prompts, params, use_tqdm=False)
            times[name].append(time.perf_counter() - t0)
            after = llm.engine.stats()
            outs[name] = [list(o.outputs[0].token_ids) for o in res]
            delta = {k: after[k] - before[k] for k in ("num_steps", "num_generation_tokens")}
            for k in ("num_spec_drafts", "num_spec_draft_tokens", "num_spec_accepted_tokens"):
                delta[k] = after[k] - before[k]
    same = sum(x == y for x, y in zip(outs["off"], outs["on"]))
    tokens = sum(len(o) for o in outs["off"])
    print(f"CPU: {cpu_name()}; {len(prompts)} requests, {tokens} output tokens; outputs equal: "
          f"{same}/{len(prompts)}")  # fmt: skip
    for name in engines:
        med = statistics.median(times[name])
        print(json.dumps({"engine": name, "median_s": round(med, 3),
                          "tok_per_s": round(tokens / med, 1),
                          "runs_s": [round(t, 3) for t in times[name]]}))  # fmt: skip
    print(json.dumps({"last_run_of_on": delta}))
    for i, (x, y) in enumerate(zip(outs["off"], outs["on"])):
        if x != y:
            j = next(j for j in range(min(len(x), len(y))) if x[j] != y[j])
            print(f"request {i}: first differs at output token {j} of {len(x)}")
    ratio = statistics.median(times["off"]) / statistics.median(times["on"])
    print(f"speed-up (median off / median on): {ratio:.2f}x")


if __name__ == "__main__":
    main()
