"""Is a greedy SmolLM2 bf16 request's output the same alone as in a batch? One request of
serve_bench's workload, alone and then with companions from the same workload, with its tokens'
log-probs, under a few engine settings; prints where the first log-prob differs from the lone run.

    .venv/bin/python experiments/batch_variance_smollm2.py [--target 5] [--companions 0,1,2,3,4,6,7]

Found while testing speculative decoding (RESULTS.md 52): the plain engine's greedy tokens for
some requests of this workload change with the batch around them.
"""

from __future__ import annotations

import argparse

from jaxserve import LLM, SamplingParams
from jaxserve.bench.core import cpu_name
from jaxserve.bench.workloads import make_workload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=int, default=5)
    ap.add_argument("--companions", default="0,1,2,3,4,6,7")
    ap.add_argument("--max_tokens", type=int, default=8)
    a = ap.parse_args()
    reqs = make_workload("longtail-small", 49152, 24, 0).requests
    prompt = lambda i: {"prompt_token_ids": list(reqs[i].prompt_token_ids)}  # noqa: E731
    sp = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True, logprobs=0)
    others = [int(i) for i in a.companions.split(",")]
    print(f"CPU: {cpu_name()}; target request {a.target} ({len(reqs[a.target].prompt_token_ids)}"
          f" prompt tokens), companions {others} (prompt lengths "
          f"{[len(reqs[i].prompt_token_ids) for i in others]})")  # fmt: skip

    def lps(out):
        c = out.outputs[0]
        return [(t, d[t].logprob) for t, d in zip(c.token_ids, c.logprobs)]

    for name, kw in (
        ("default", {}),
        ("async_scheduling=False", {"async_scheduling": False}),
        ("enable_prefix_caching=False", {"enable_prefix_caching": False}),
        ("max_num_batched_tokens=64 (one chunk a step)", {"max_num_batched_tokens": 64}),
        ("slot_buckets=(8,)", {"slot_buckets": (8,)}),
        ("slot_buckets=(4, 8)", {"slot_buckets": (4, 8)}),
    ):
        llm = LLM(dtype="bfloat16", num_slots=8, **kw)
        alone = lps(llm.generate(prompt(a.target), sp, use_tqdm=False)[0])
        batch = [prompt(a.target)] + [prompt(i) for i in others]
        together = lps(llm.generate(batch, sp, use_tqdm=False)[0])
        first = next((j for j, (x, y) in enumerate(zip(alone, together)) if x != y), None)
        where = "identical" if first is None else f"first differs at token {first}: "
        if first is not None:
            where += f"alone {alone[first]}, in the batch {together[first]}"
        print(f"{name}: {where}")


if __name__ == "__main__":
    main()
