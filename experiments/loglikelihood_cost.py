"""What a loglikelihood request costs: prompt log-probs as lm-evaluation-harness asks for them
(`echo` + `logprobs=1` + one token; offline `prompt_logprobs=1, max_tokens=1`), SmolLM2-135M-Instruct
bf16 on this machine, next to the same prompts without prompt log-probs.

    PYTHONPATH=<checkout> .venv/bin/python experiments/loglikelihood_cost.py --out OUT.jsonl

`--num_prompts` prompts (8 to ~200 tokens, cut from a fixed English text) are sent one at a time,
as lm-eval's `local-completions` does by default (batch_size=1, num_concurrent=1), then all at
once. Each mode runs `--repeats` times after warm-up; the JSON line holds every pass's seconds
and the median per-request latency. Run it from two checkouts (PYTHONPATH) to compare them; it
uses only APIs both sides of a change have.
"""

from __future__ import annotations

import statistics
import time

from absl import app, flags

from jaxserve import LLM, SamplingParams
from jaxserve.bench.core import append_row_jsonl, cpu_name

_N = flags.DEFINE_integer("num_prompts", 16, "Prompts per pass.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Passes per mode.")
_OUT = flags.DEFINE_string("out", None, "Append one JSON line here.")
_LABEL = flags.DEFINE_string("label", "", "A name for this checkout in the JSON line.")

TEXT = (
    "The history of the city begins with a small settlement on the river, where traders met to "
    "exchange grain, salt and cloth. Over the centuries the settlement grew into a market town, "
    "then into a city with walls, churches and a university. Its people built bridges across the "
    "river and canals through the marshes, and the harbour became one of the busiest in the "
    "region. Wars and plagues came and went; each time the city was rebuilt, a little larger than "
    "before. In the nineteenth century the railway arrived, factories rose along the canals, and "
    "the population tripled in fifty years. Today the old town is a place for visitors, while the "
    "new districts to the east hold offices, laboratories and the port's container terminals. "
)


def main(argv):
    del argv
    llm = LLM(dtype="bfloat16", warmup=True)
    ids = llm.tokenizer(TEXT * 4)["input_ids"]
    lengths = [8 + (192 * i) // max(1, _N.value - 1) for i in range(_N.value)]
    prompts = [{"prompt_token_ids": ids[i : i + n]} for i, n in enumerate(lengths)]
    modes = {
        "loglikelihood": SamplingParams(temperature=0, max_tokens=1, logprobs=1, prompt_logprobs=1),
        "plain": SamplingParams(temperature=0, max_tokens=1),
    }
    row = {"cpu": cpu_name(), "label": _LABEL.value, "date": time.strftime("%Y-%m-%d %H:%M UTC")}
    row["prompt_tokens"] = sum(lengths)
    for name, sp in modes.items():
        llm.generate(prompts[:2], sp, use_tqdm=False)  # warm (nothing compiles: warmup=True)
        one, batch, per_request = [], [], []
        for _ in range(_REPEATS.value):
            t0 = time.perf_counter()
            for p in prompts:
                t = time.perf_counter()
                llm.generate([p], sp, use_tqdm=False)
                per_request.append(time.perf_counter() - t)
            one.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            batch.append(time.perf_counter() - t0)
        row[name] = {
            "one_at_a_time_s": [round(x, 3) for x in one],
            "all_at_once_s": [round(x, 3) for x in batch],
            "median_request_s": round(statistics.median(per_request), 4),
        }
    append_row_jsonl(_OUT.value, row)


if __name__ == "__main__":
    app.run(main)
