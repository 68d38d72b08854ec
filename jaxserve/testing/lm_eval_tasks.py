"""A local lm-evaluation-harness task (YAML over a JSONL file, no hub data), for the tests and the
experiments that run lm-eval as a client:

    write_multiple_choice_task(folder, "tiny_mc", rows)    # rows: {"question", "choices", "answer"}
    lm_eval.simple_evaluate(..., tasks=["tiny_mc"], task_manager=TaskManager(include_path=folder))
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
