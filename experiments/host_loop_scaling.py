r"""Host cost per request of `LLM.iter_generate` and the host loop as the request count grows.

The engine behind `LLM` is the real host loop (`LLMEngine`, `Scheduler`, output processing) over
`jaxserve/testing/fake_runner.py`'s numpy model, so no device time is counted: what is left is the
host's bookkeeping per request, which should stay flat from 1k to 256k requests (issue 24: the old
`iter_generate` rescanned every outstanding request after every step, O(requests x steps)).

    .venv/bin/python experiments/host_loop_scaling.py --counts=1000,16000,256000

Prints host ms per request for each count (one-token prompts, 2 output tokens, 256 slots).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from absl import app, flags

from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.core.engine import LLMEngine
from jaxserve.testing.fake_runner import FakeRunner

_COUNTS = flags.DEFINE_list("counts", ["1000", "16000", "256000"], "Request counts to time.")
_SLOTS = flags.DEFINE_integer("slots", 256, "Engine slots.")
_JSON = flags.DEFINE_string("json", None, "Write the rows here as JSON.")


def fake_llm(num_slots: int) -> LLM:
    """The tiny dummy LLM with its engine rebuilt over the numpy fake runner."""
    llm = LLM("tiny", load_format="dummy", dtype="float32", num_slots=1, max_model_len=64)
    ec = EngineConfig(
        num_slots=num_slots,
        max_model_len=64,
        page_size=16,
        prefill_chunk_size=16,
        max_num_batched_tokens=16 * num_slots,
        dtype="float32",
    ).for_model(llm.model_config)
    num_pages = num_slots * ec.max_pages_per_seq
    runner = FakeRunner(num_slots, num_pages, 16, rows=num_slots, chunk=16)
    llm.engine = LLMEngine(runner, llm.model_config, ec, num_pages)
    return llm


def main(argv):
    del argv
    rows = []
    for n in map(int, _COUNTS.value):
        llm = fake_llm(_SLOTS.value)
        prompts = [{"prompt_token_ids": [3 + i % 100]} for i in range(n)]
        sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        t0, c0 = time.perf_counter(), time.process_time()
        done = sum(1 for _ in llm.iter_generate(prompts, sp))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        assert done == n
        row = {"requests": n, "wall_s": wall, "host_ms_per_request": 1e3 * cpu / n}
        row["steps"] = llm.stats()["num_steps"]
        rows.append(row)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}))
    if _JSON.value:
        Path(_JSON.value).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    app.run(main)
