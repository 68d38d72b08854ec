"""lm-evaluation-harness as a client, timed: its `local-completions` model scores a local
multiple-choice task (`--num_questions` x 3 choices, one loglikelihood request each) against a
running OpenAI-compatible server, as a researcher would run it (default batch_size=1 and
num_concurrent=1: one request at a time).

    .venv/bin/python -m jaxserve.launch.serve --dtype=bfloat16 --port 8012 --served_model_name smollm2 &
    .venv/bin/python experiments/lm_eval_loglikelihood.py --base_url http://127.0.0.1:8012/v1 \
        --label after --out OUT.jsonl

Prints (and appends to --out) one JSON line: the wall time of `lm_eval.simple_evaluate`, the
number of requests, the accuracy and every loglikelihood (so two servers' lines can be compared
for equality). The task's rows are written here (no hub data); the tokenizer is SmolLM2's, from
the cached GGUF. Needs `pip install -e '.[test]'` (lm-eval).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from absl import app, flags

_BASE_URL = flags.DEFINE_string("base_url", "http://127.0.0.1:8000/v1", "The server's /v1 URL.")
_MODEL = flags.DEFINE_string("model", "smollm2", "The served model name.")
_N = flags.DEFINE_integer("num_questions", 30, "Multiple-choice questions (3 choices each).")
_LABEL = flags.DEFINE_string("label", "", "A name for this run in the JSON line.")
_OUT = flags.DEFINE_string("out", None, "Append the JSON line here.")

WORDS = ["river", "city", "market", "bridge", "harbour", "railway", "factory", "canal", "church"]


def task_rows(n: int) -> list[dict]:
    return [
        {
            "question": f"Question {i}: in the old story, the town was famous for its "
            f"{WORDS[i % len(WORDS)]} and its",
            "choices": [WORDS[(i + k) % len(WORDS)] for k in (1, 3, 7)],
            "answer": i % 3,
        }
        for i in range(n)
    ]


def main(argv):
    del argv
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from jaxserve.bench.core import append_row_jsonl, cpu_name
    from jaxserve.loading.default_model import smollm2_gguf_path
    from jaxserve.loading.tokenizer import load_tokenizer
    from jaxserve.testing.lm_eval_tasks import (
        score_with_local_completions,
        write_multiple_choice_task,
    )

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_multiple_choice_task(folder, "mc_bench", task_rows(_N.value))
        load_tokenizer(smollm2_gguf_path()).save_pretrained(folder / "tokenizer")
        t0 = time.perf_counter()
        results, ll = score_with_local_completions(
            _BASE_URL.value, _MODEL.value, folder, "mc_bench", folder / "tokenizer",
            ",max_length=2048",
        )  # fmt: skip
        wall = time.perf_counter() - t0
    row = {
        "label": _LABEL.value,
        "cpu": cpu_name(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "wall_s": round(wall, 2),
        "requests": len(ll),
        "acc": results["results"]["mc_bench"]["acc,none"],
        "loglikelihoods": ll,
    }
    append_row_jsonl(_OUT.value, row)


if __name__ == "__main__":
    app.run(main)
