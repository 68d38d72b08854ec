"""`python -m jaxserve.launch.generate`: argument checks, shards + merge, resume, summary (fake LLM);
then real runs of the tiny dummy model in subprocesses: SIGKILL/resume and SIGTERM."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from absl import flags

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "batch"))
from batch_fakes import FakeLLM, expected_text  # noqa: E402

from jaxserve.batch.merge import merge_outputs  # noqa: E402
from jaxserve.launch import generate  # noqa: E402

FLAGS = flags.FLAGS


@pytest.fixture
def run_main(monkeypatch):
    """Runs generate.main in this process with the given flags and a FakeLLM; returns (rc, llms)."""
    llms = []

    def make_llm(**kwargs):
        llms.append((kwargs, FakeLLM(max_model_len=64)))
        return llms[-1][1]

    monkeypatch.setattr(generate, "make_llm", make_llm)

    def run(*args):
        FLAGS.unparse_flags()
        FLAGS(["generate", "--noprogress", *args])
        try:
            return generate.main(["generate"]), llms
        finally:
            FLAGS.unparse_flags()

    return run


def write_rows(path: Path, n: int, extra: list[str] = ()) -> Path:
    lines = [json.dumps({"id": f"q{i}", "prompt": f"prompt {i}"}) for i in range(n)]
    path.write_text("\n".join(lines + list(extra)) + "\n")
    return path


def read(path) -> list[dict]:
    return [json.loads(x) for x in open(path, encoding="utf-8")]


def test_bad_paths_fail_before_the_model_loads(tmp_path, run_main, capsys):
    rc, llms = run_main(f"--input={tmp_path}/missing.jsonl", f"--output={tmp_path}/o.jsonl")
    assert rc == 2 and not llms
    assert "missing.jsonl" in capsys.readouterr().err
    inp = write_rows(tmp_path / "in.jsonl", 2)
    (tmp_path / "file").write_text("x")
    rc, llms = run_main(f"--input={inp}", f"--output={tmp_path}/file/o.jsonl")
    assert rc == 2 and not llms
    assert "cannot create output directory" in capsys.readouterr().err
    rc, llms = run_main(f"--input={inp}", f"--output={tmp_path}/o.jsonl", "--top_p=1.5")
    assert rc == 2 and not llms
    assert "top_p" in capsys.readouterr().err
    rc, _ = run_main(
        f"--input={inp}", f"--output={tmp_path}/o.jsonl", "--num_shards=2", "--shard_index=2"
    )
    assert rc == 2 and "shard_index" in capsys.readouterr().err


def test_shards_merge_resume_and_summary(tmp_path, run_main):
    inp = write_rows(tmp_path / "in.jsonl", 30, extra=['{"id": "q3", "prompt": "dup"}', "{oops"])
    outs = [tmp_path / "out" / f"shard-{i}.jsonl" for i in range(3)]
    flagfile = tmp_path / "job.flags"
    flagfile.write_text(
        "--num_shards=3\n--max_tokens=3\n--model=tiny\n--load_format=dummy\n--num_slots=4\n"
        "--kv_cache_memory=1MiB\n"
    )
    for i, out in enumerate(outs):
        rc, llms = run_main(
            f"--input={inp}", f"--output={out}", f"--flagfile={flagfile}", f"--shard_index={i}"
        )
        assert rc == 0
    kwargs = llms[0][0]
    assert (
        kwargs["model"] == "tiny" and kwargs["load_format"] == "dummy" and kwargs["num_slots"] == 4
    )
    assert "dtype" not in kwargs  # unset engine flags keep the engine's defaults
    sizes = [len(read(o)) for o in outs]
    assert sum(sizes) == 32 and min(sizes) > 0
    summ = json.loads((tmp_path / "out" / "shard-0.summary.json").read_text())
    assert summ["complete"] and summ["rows"]["in_shard"] == sizes[0]
    assert summ["rows"]["ok"] + summ["rows"]["failed"] == sizes[0]
    assert summ["engine"]["kv_page_utilization"] == 0.25
    assert summ["model"] == "fake" and summ["model_load_s"] >= 0
    assert summ["this_run"]["ttft_s"]["p50"] > 0

    merged = tmp_path / "all.jsonl"
    report = merge_outputs([str(o) for o in outs], str(merged), str(inp))
    assert report.ok and report.rows_written == 32 and report.num_failed == 2
    rows = read(merged)
    assert [r["line"] for r in rows] == list(range(1, 33))  # input order
    assert rows[5]["text"] == expected_text(list(b"prompt 5"), 3)
    assert "duplicate id 'q3'" in rows[30]["error"] and "malformed JSON" in rows[31]["error"]

    # A rerun of a finished shard does nothing and does not load the model.
    n_before = len(llms)
    rc, llms = run_main(
        f"--input={inp}", f"--output={outs[1]}", "--num_shards=3", "--shard_index=1"
    )
    assert rc == 0 and len(llms) == n_before and len(read(outs[1])) == sizes[1]
    rerun = json.loads((tmp_path / "out" / "shard-1.summary.json").read_text())
    assert rerun["complete"] and rerun["rows"]["skipped_already_done"] == sizes[1]
    assert rerun["rows"]["this_run"] == {"ok": 0, "failed": 0} and rerun["engine"] is None


# -- real runs: the tiny dummy model in subprocesses ---------------------------------------------

ENGINE_ARGS = [
    "--model=tiny",
    "--load_format=dummy",
    "--dtype=float32",
    "--num_slots=4",
    "--max_model_len=64",
    "--temperature=0",
    "--ignore_eos",
    "--output_token_ids",
    "--noprogress",
]


def real_input(path: Path) -> Path:
    """44 greedy rows of varied lengths, plus a malformed row and a prompt over max_model_len."""
    lines = []
    for i in range(44):
        ids = [3 + (i * 7 + k) % 120 for k in range(2 + i % 11)]
        lines.append(json.dumps({"id": f"r{i}", "prompt_token_ids": ids, "max_tokens": 6 + i % 17}))
    lines.insert(10, '{"id": "broken", "prompt_token_ids": [1, 2}')
    lines.insert(30, json.dumps({"id": "long", "prompt_token_ids": [5] * 80}))
    path.write_text("\n".join(lines) + "\n")
    return path


def start(inp: Path, out: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "jaxserve.launch.generate", f"--input={inp}", f"--output={out}"]
        + ENGINE_ARGS,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def count_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def signal_after_rows(proc, out: Path, new_rows: int, sig: int, timeout=240.0) -> tuple[int, int]:
    """Sends `sig` once `out` has `new_rows` more lines; returns (lines at signal, return code)."""
    base = count_lines(out)
    deadline = time.monotonic() + timeout
    while proc.poll() is None and count_lines(out) < base + new_rows:
        assert time.monotonic() < deadline, "no rows appeared in time"
        time.sleep(0.02)
    seen = count_lines(out)
    if proc.poll() is None:
        proc.send_signal(sig)
    rc = proc.wait(timeout=120)
    return seen, rc


def by_key(rows: list[dict]) -> dict[str, dict]:
    keyed = {}
    for r in rows:
        key = json.dumps(r["id"]) if r["id"] is not None else f"line:{r['line']}"
        assert key not in keyed, f"{key} appears twice"
        keyed[key] = r
    return keyed


@pytest.mark.slow  # ~6 jax processes: ~45 s of CPU, 2.5 min wall on a busy 2-core machine
def test_sigkill_and_sigterm_then_resume_equals_uninterrupted_run(tmp_path):
    inp = real_input(tmp_path / "in.jsonl")
    env = dict(os.environ)
    env |= {
        "JAX_PLATFORMS": "cpu",
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax_cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }
    ref_out = tmp_path / "reference.jsonl"
    reference = start(inp, ref_out, env)  # runs alongside the interrupted chain below
    out = tmp_path / "out.jsonl"
    rng = random.Random(6)
    figures = []
    for _ in range(3):
        proc = start(inp, out, env)
        seen, rc = signal_after_rows(proc, out, rng.randint(1, 6), signal.SIGKILL)
        figures.append((seen, rc))
        assert rc == -signal.SIGKILL, proc.stdout.read()
    # A crash in the middle of a write leaves a torn line; the next run must cut it off.
    with open(out, "ab") as f:
        f.write(b'{"id": "r43", "line": 46, "text": "", "finish_rea')
    proc = start(inp, out, env)
    seen, rc = signal_after_rows(proc, out, rng.randint(1, 4), signal.SIGTERM)
    log = proc.stdout.read()
    assert rc == 128 + signal.SIGTERM, log
    assert "interrupted by SIGTERM" in log and "Rerun the same command to resume" in log
    assert "torn last line" in log
    summ = json.loads((tmp_path / "out.summary.json").read_text())
    assert summ["interrupted"] == "SIGTERM" and not summ["complete"]
    assert summ["rows"]["remaining"] > 0, "the SIGTERM came after every row was done"
    figures.append((seen, rc))

    final = start(inp, out, env)
    log = final.communicate(timeout=240)[0]
    assert final.returncode == 0, log
    assert reference.wait(timeout=240) == 0, reference.stdout.read()

    got = by_key(read(out))
    want = by_key(read(ref_out))
    assert len(want) == 46 and set(got) == set(want)
    for key, row in want.items():
        assert got[key] == row, key
    assert "line 11" in got["line:11"]["error"] and "malformed JSON" in got["line:11"]["error"]
    assert "line 31" in got['"long"']["error"] and "max_model_len" in got['"long"']["error"]
    summ = json.loads((tmp_path / "out.summary.json").read_text())
    assert summ["complete"] and summ["rows"]["ok"] == 44 and summ["rows"]["failed"] == 2
    print("rows in the output at each interruption (SIGKILL x3, SIGTERM):", figures)
