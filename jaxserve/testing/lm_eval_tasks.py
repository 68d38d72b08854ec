"""A local lm-evaluation-harness task (YAML over a JSONL file, no hub data), for the tests and the
experiments that run lm-eval as a client:

    write_multiple_choice_task(folder, "tiny_mc", rows)    # rows: {"question", "choices", "answer"}
    results, lls = score_with_local_completions(base_url, model, folder, "tiny_mc", tokenizer_dir)
"""

from __future__ import annotations

import json
from pathlib import Path


def write_multiple_choice_task(folder: Path, name: str, rows: list[dict]) -> None:
    """`folder/<name>.yaml`: a multiple-choice task scored by accuracy over `folder/<name>.jsonl`."""
    data = Path(folder) / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (Path(folder) / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n"
    )


def score_with_local_completions(
    base_url: str, model: str, folder: Path, task: str, tokenizer_dir: Path, model_args: str = ""
) -> tuple[dict, list[float]]:
    """lm-eval's `local-completions` client on a task `write_multiple_choice_task` wrote into
    `folder`, against an OpenAI-compatible server at `base_url` (its /v1), with token-id requests
    from the Hugging Face tokenizer saved in `tokenizer_dir`; `model_args` adds lm-eval's own
    (",max_length=256,..."). Returns (lm-eval's results, each request's loglikelihood in document
    order)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=(
            f"model={model},base_url={base_url}/completions,tokenizer_backend=huggingface,"
            f"tokenizer={tokenizer_dir},tokenized_requests=True{model_args}"
        ),
        tasks=[task],
        task_manager=TaskManager(include_path=str(folder)),
        log_samples=True,
    )
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return results, [float(r[0][0]) for s in samples for r in s["resps"]]
