"""Prefill chunk size A/B on SmolLM2 (CPU): 64-token chunks x 8 per step vs 256 x 2 per step.

Short chat prompts (the batch-job case) padded to a 256-token chunk waste most of the prefill, and
only two are admitted per step. Both configurations run in one process, one after the other, each
timed on its second `chat` call (the first compiles).

    .venv/bin/python experiments/prefill_chunk_ab.py
"""

import json
import time

from jaxserve import LLM, SamplingParams

TOPICS = ["the ocean", "mountains", "a city", "music", "rain", "coffee", "trains", "the moon"]
KINDS = ["Write one sentence about", "Give a short fact about", "Describe in a few words"]


def main():
    prompts = [f"{KINDS[i % 3]} {TOPICS[i % 8]} (#{i})." for i in range(96)]
    msgs = [[{"role": "user", "content": p}] for p in prompts]
    sp = SamplingParams(temperature=0, max_tokens=32)
    results = {}
    for chunk in (64, 256):
        llm = LLM(
            None,
            dtype="bfloat16",
            num_slots=32,
            max_model_len=256,
            prefill_chunk_size=chunk,
            max_num_batched_tokens=512,
        )
        llm.chat(msgs[:40], sp, use_tqdm=False)  # compiles the variants this workload uses
        t = time.perf_counter()
        outs = llm.chat(msgs[40:], sp, use_tqdm=False)
        dt = time.perf_counter() - t
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        results[chunk] = {"rows": len(outs), "tokens": n, "seconds": dt, "tok_per_s": n / dt}
        print(f"chunk {chunk}: {len(outs)} rows, {n} tokens in {dt:.1f} s = {n / dt:.1f} tok/s")
    print(json.dumps({"ratio_64_over_256": results[64]["tok_per_s"] / results[256]["tok_per_s"]}))


if __name__ == "__main__":
    main()
