"""Merging shard outputs: order, missing / duplicated / unexpected ids, torn shards, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve.batch.merge import merge_outputs
from jaxserve.batch.reader import read_input


def out_row(i, line=None, error=None):
    return {"id": f"q{i}", "line": line or i + 1, "text": f"t{i}", "error": error}


def write_jsonl(path: Path, rows: list[dict], tail: bytes = b"") -> str:
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in rows) + tail)
    return str(path)


@pytest.fixture
def job(tmp_path):
    """An input of 6 rows (one malformed) and two shard outputs that cover it exactly."""
    lines = [json.dumps({"id": f"q{i}", "prompt": f"p{i}"}) for i in range(5)] + ["{bad"]
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    key = read_input(str(inp))[5].key  # a bad row is keyed by its content
    bad = {"id": None, "key": key, "line": 6, "text": None, "error": "line 6: malformed JSON"}
    a = write_jsonl(tmp_path / "a.jsonl", [out_row(3), out_row(0), bad])
    b = write_jsonl(tmp_path / "b.jsonl", [out_row(4), out_row(1), out_row(2)])
    return str(inp), a, b


def test_merge_orders_by_input(tmp_path, job):
    inp, a, b = job
    report = merge_outputs([a, b], str(tmp_path / "all.jsonl"), inp)
    assert report.ok and report.rows_written == 6 and report.num_failed == 1
    rows = [json.loads(x) for x in open(tmp_path / "all.jsonl")]
    assert [r["line"] for r in rows] == [1, 2, 3, 4, 5, 6]
    # Without the input: shard order, nothing can be called missing.
    report = merge_outputs([a, b], str(tmp_path / "cat.jsonl"))
    assert report.ok and report.missing == []
    assert [json.loads(x)["line"] for x in open(tmp_path / "cat.jsonl")] == [4, 1, 6, 5, 2, 3]


def test_merge_reports_missing_duplicated_unexpected_and_torn(tmp_path, job):
    inp, a, _ = job
    b = write_jsonl(
        tmp_path / "b2.jsonl",
        [out_row(4), out_row(0), out_row(9)],
        tail=b'{"id": "q1", "li',  # a shard killed mid-write and never rerun
    )
    report = merge_outputs([a, b], str(tmp_path / "all.jsonl"), inp)
    assert not report.ok
    assert report.missing == ['"q1"', '"q2"']
    assert report.duplicated == {'"q0"': 2}
    assert report.unexpected == ['"q9"']
    assert report.torn == [b]
    with pytest.raises(ValueError, match="does not exist"):
        merge_outputs([a, str(tmp_path / "nope.jsonl")], str(tmp_path / "x.jsonl"))
    with pytest.raises(ValueError, match="also one of the inputs"):
        merge_outputs([a], a)


def merge_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jaxserve.launch.merge", *args], capture_output=True, text=True
    )


def test_merge_command_line_exit_codes(tmp_path, job):
    inp, a, b = job
    ok = merge_cli(f"--inputs={a},{b}", f"--output={tmp_path}/all.jsonl", f"--expected_input={inp}")
    assert ok.returncode == 0, ok.stderr
    assert "6 rows from 2 files" in ok.stdout and "(1 failed rows among them)" in ok.stdout
    bad = merge_cli(f"--inputs={a},{a}", f"--output={tmp_path}/x.jsonl", f"--expected_input={inp}")
    assert bad.returncode == 1
    assert 'MISSING 3 ids: "q1", "q2", "q4"' in bad.stdout
    assert "DUPLICATED 3 ids" in bad.stdout and '"q3" (x2)' in bad.stdout
    usage = merge_cli(f"--output={tmp_path}/x.jsonl")
    assert usage.returncode == 2 and "--inputs" in usage.stderr


def test_merge_command_line_names_a_non_object_row(tmp_path, job):
    inp, a, b = job
    with open(b, "ab") as f:
        f.write(b"[1, 2]\n")
    bad = merge_cli(
        f"--inputs={a},{b}", f"--output={tmp_path}/all.jsonl", f"--expected_input={inp}"
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "b.jsonl' line 4 is not a jaxserve output row (a JSON list" in bad.stderr


def test_merge_takes_the_last_row_of_an_id_within_a_shard(tmp_path, job):
    inp, a, b = job
    with open(b, "ab") as f:  # a rerun redid q4 (its request changed) and appended its row
        f.write(json.dumps(out_row(4) | {"text": "redone"}).encode() + b"\n")
    report = merge_outputs([a, b], str(tmp_path / "all.jsonl"), inp)
    assert report.ok and report.rows_written == 6 and report.duplicated == {}
    rows = {r["id"]: r for r in map(json.loads, open(tmp_path / "all.jsonl"))}
    assert rows["q4"]["text"] == "redone"
