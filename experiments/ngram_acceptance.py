"""How many tokens a step would make with prompt-lookup speculative decoding (vLLM's `ngram`
method), on a benchmark workload's greedy outputs: an upper bound for speculative decoding there,
measured without building it.

It generates the workload's requests greedily with `LLM` (as `serve_bench.py` asks the server:
temperature 0, ignore_eos, max_tokens from the workload), then replays each output: at every step
the proposer looks for the longest n-gram (n from --max_n down to --min_n) ending the context
(prompt and tokens so far) at an earlier place, takes the latest such place, and proposes the k
tokens that followed it; the step makes the proposal's longest correct prefix plus one token (the
target model's own). Printed per k: tokens per step (1.0 = no speculation) and the steps needed.

    .venv/bin/python experiments/ngram_acceptance.py [--workload longtail-small] [--num_requests 48]

Greedy outputs of a 135M model on random-token prompts repeat themselves a great deal, so these
figures say what the benchmark would allow, not what real text gives.
"""

from __future__ import annotations

import argparse
import json

from jaxserve import LLM
from jaxserve.bench.core import cpu_name, prompts_for, sampling_params_for
from jaxserve.bench.workloads import make_workload


def propose(context: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest n-gram ending
    `context` (n from max_n down to min_n); [] when none occurs."""
    for n in range(max_n, min_n - 1, -1):
        if len(context) <= n:
            continue
        tail = context[-n:]
        for i in range(len(context) - n - 1, -1, -1):
            if context[i : i + n] == tail:
                return context[i + n : i + n + k]
    return []


def replay(prompt: list[int], output: list[int], k: int, max_n: int, min_n: int) -> int:
    """Steps to produce output[1:] (the first token comes from the prefill) with proposals of k."""
    context, i, steps = list(prompt) + output[:1], 1, 0
    while i < len(output):
        draft = propose(context, k, max_n, min_n)
        accepted = 0
        while accepted < len(draft) and i + accepted < len(output):
            if draft[accepted] != output[i + accepted]:
                break
            accepted += 1
        made = min(accepted + 1, len(output) - i)
        context += output[i : i + made]
        i, steps = i + made, steps + 1
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="longtail-small")
    ap.add_argument("--num_requests", type=int, default=48)
    ap.add_argument("--vocab_size", type=int, default=49152)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ks", default="1,2,3,4,6")
    ap.add_argument("--max_n", type=int, default=4)
    ap.add_argument("--min_n", type=int, default=1)
    a = ap.parse_args()
    workload = make_workload(a.workload, a.vocab_size, a.num_requests, a.seed)
    llm = LLM(dtype="bfloat16", num_slots=32)
    prompts, params = prompts_for(workload), sampling_params_for(workload)
    outs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    tokens = sum(len(o) - 1 for o in outs)
    distinct = sorted(len(set(o)) / len(o) for o in outs)
    print(f"CPU: {cpu_name()}; {len(outs)} requests, {tokens} decoded tokens; distinct tokens "
          f"per output: {distinct[0]:.0%} to {distinct[-1]:.0%}, median "
          f"{distinct[len(distinct) // 2]:.0%}")  # fmt: skip
    for k in map(int, a.ks.split(",")):
        steps = sum(
            replay(list(r.prompt_token_ids), o, k, a.max_n, a.min_n)
            for r, o in zip(workload.requests, outs)
        )
        print(json.dumps({"k": k, "steps": steps, "tokens_per_step": round(tokens / steps, 2)}))


if __name__ == "__main__":
    main()
