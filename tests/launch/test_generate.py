"""`python -m jaxserve.launch.generate`: argument checks, shards + merge, resume, summary (fake LLM);
then real runs of the tiny dummy model in subprocesses: SIGKILL/resume and SIGTERM."""

from __future__ import annotations

import errno
import json
import os
import random
import resource
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
from jaxserve.batch.resume import output_key  # noqa: E402
from jaxserve.batch.writer import OutputWriter  # noqa: E402
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
        f"--input={inp}", f"--output={outs[1]}", f"--flagfile={flagfile}", "--shard_index=1"
    )
    assert rc == 0 and len(llms) == n_before and len(read(outs[1])) == sizes[1]
    rerun = json.loads((tmp_path / "out" / "shard-1.summary.json").read_text())
    assert rerun["complete"] and rerun["rows"]["skipped_already_done"] == sizes[1]
    assert rerun["rows"]["this_run"] == {"ok": 0, "failed": 0} and rerun["engine"] is None


def test_output_safety_exit_codes(tmp_path, run_main, capsys, monkeypatch):
    inp = write_rows(tmp_path / "in.jsonl", 4)
    before = inp.read_bytes()
    (tmp_path / "link.jsonl").symlink_to(inp)
    for out in (inp, tmp_path / "link.jsonl"):  # the input itself: always refused
        for extra in ([], ["--overwrite"]):
            rc, llms = run_main(f"--input={inp}", f"--output={out}", *extra)
            assert rc == 2 and not llms and "is the input file" in capsys.readouterr().err
    assert inp.read_bytes() == before
    rc, _ = run_main(f"--input={inp}", "--output=/dev/full")
    assert rc == 2 and "not a regular file" in capsys.readouterr().err
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    rc, llms = run_main(f"--input={inp}", f"--output={notes}")
    assert rc == 2 and not llms and "not a jaxserve output" in capsys.readouterr().err
    assert notes.read_text() == "my notes\n"
    rc, _ = run_main(f"--input={inp}", f"--output={notes}", "--overwrite")
    assert rc == 0 and len(read(notes)) == 4

    out = tmp_path / "out.jsonl"
    holder = OutputWriter(str(out))
    holder.open()  # another job writing this output
    rc, llms = run_main(f"--input={inp}", f"--output={out}")
    err = capsys.readouterr().err
    assert rc == 3 and len(llms) == 1 and f"pid {os.getpid()}" in err  # no model loaded
    assert "another running job" in err
    holder.close()

    real_write = os.write

    def disk_full(fd, data):
        if fd != 1 and fd != 2 and b'"q2"' in bytes(data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    with monkeypatch.context() as patch:
        patch.setattr("jaxserve.batch.writer.os.write", disk_full)
        rc, _ = run_main(f"--input={inp}", f"--output={out}")
    err = capsys.readouterr().err
    assert rc == 4 and "disk full" in err and "rerun" in err
    summ = json.loads((tmp_path / "out.summary.json").read_text())
    assert not summ["complete"] and summ["output_error"] == 4
    rc, _ = run_main(f"--input={inp}", f"--output={out}")
    assert rc == 0 and sorted(r["id"] for r in read(out)) == ["q0", "q1", "q2", "q3"]


def test_changed_input_is_redone_and_the_file_compacted(tmp_path, run_main, caplog):
    inp = write_rows(tmp_path / "in.jsonl", 4, extra=['{"id": "bad", "prompt": "x", "top_p": 9}'])
    out = tmp_path / "out.jsonl"
    assert run_main(f"--input={inp}", f"--output={out}", "--max_tokens=3")[0] == 0
    lines = inp.read_text().splitlines()
    lines[1] = json.dumps({"id": "q1", "prompt": "a new question"})
    lines[4] = '{"id": "bad", "prompt": "x"}'  # fixed
    inp.write_text("\n".join(lines) + "\n")
    rc, llms = run_main(f"--input={inp}", f"--output={out}", "--max_tokens=3")
    assert rc == 0 and len(llms[-1][1].submitted) == 2
    assert "1 rows changed" in caplog.text and '"q1"' in caplog.text
    rows = read(out)
    assert sorted(r["id"] for r in rows) == ["bad", "q0", "q1", "q2", "q3"]  # one row per id
    by_id = {r["id"]: r for r in rows}
    assert by_id["q1"]["text"] == expected_text(list(b"a new question"), 3)
    assert by_id["bad"].get("error") is None
    summ = json.loads((tmp_path / "out.summary.json").read_text())
    assert summ["complete"] and summ["redone_changed"] == 1 and summ["retried_errors"] == 1
    # The same command again: nothing to do, and a different --max_tokens redoes every row.
    rc, llms = run_main(f"--input={inp}", f"--output={out}", "--max_tokens=3")
    assert rc == 0 and len(llms) == 2
    rc, llms = run_main(f"--input={inp}", f"--output={out}", "--max_tokens=2")
    assert rc == 0 and len(llms[-1][1].submitted) == 5 and len(read(out)) == 5


def test_a_reader_never_sees_two_rows_of_one_id(tmp_path, run_main, monkeypatch):
    """Issue 58: a rerun retries an error row (a prompt over max_model_len fails by design) and
    redoes a changed row; the file must hold at most one row per id after every write, not only
    once the run has finished and compacted (a reader after a crash sees the file as it is)."""
    long_prompt = "x" * 100  # over the FakeLLM's max_model_len of 64 bytes
    inp = write_rows(
        tmp_path / "in.jsonl", 3, extra=[json.dumps({"id": "long", "prompt": long_prompt})]
    )
    out = tmp_path / "out.jsonl"
    seen = []
    write = OutputWriter.write

    def write_and_look(self, row):  # what a reader of the file sees after each append
        write(self, row)
        keys = [output_key(r) for r in read(self.path)]
        seen.append(len(keys) - len(set(keys)))

    monkeypatch.setattr(OutputWriter, "write", write_and_look)
    assert run_main(f"--input={inp}", f"--output={out}", "--max_tokens=3")[0] == 0
    lines = inp.read_text().splitlines()
    lines[0] = json.dumps({"id": "q0", "prompt": "a new question"})
    inp.write_text("\n".join(lines) + "\n")
    seen.clear()
    assert run_main(f"--input={inp}", f"--output={out}", "--max_tokens=3")[0] == 0
    assert len(seen) == 2 and seen == [0, 0], seen  # q0 redone, "long" retried (fails again)
    rows = read(out)
    assert sorted(r["id"] for r in rows) == ["long", "q0", "q1", "q2"]
    assert "max_model_len" in {r["id"]: r for r in rows}["long"]["error"]


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


def real_env(tmp_path: Path, cache: bool = True) -> dict:
    env = dict(os.environ) | {"JAX_PLATFORMS": "cpu"}
    if cache:
        env |= {
            "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax_cache"),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        }
    return env


def start(inp: Path, out: Path, env: dict, max_file_bytes: int | None = None) -> subprocess.Popen:
    """A real generate run; `max_file_bytes` sets RLIMIT_FSIZE (`ulimit -f`) in the child."""

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))

    return subprocess.Popen(
        [sys.executable, "-m", "jaxserve.launch.generate", f"--input={inp}", f"--output={out}"]
        + ENGINE_ARGS,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        preexec_fn=limit if max_file_bytes is not None else None,
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
        key = output_key(r)
        assert key not in keyed, f"{key} appears twice"
        keyed[key] = r
    return keyed


@pytest.mark.slow  # ~6 jax processes: ~45 s of CPU, 2.5 min wall on a busy 2-core machine
def test_sigkill_and_sigterm_then_resume_equals_uninterrupted_run(tmp_path):
    inp = real_input(tmp_path / "in.jsonl")
    env = real_env(tmp_path)
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
    broken = [r for r in got.values() if r["line"] == 11][0]
    assert "line 11" in broken["error"] and "malformed JSON" in broken["error"]
    assert "line 31" in got['"long"']["error"] and "max_model_len" in got['"long"']["error"]
    summ = json.loads((tmp_path / "out.summary.json").read_text())
    assert summ["complete"] and summ["rows"]["ok"] == 44 and summ["rows"]["failed"] == 2
    print("rows in the output at each interruption (SIGKILL x3, SIGTERM):", figures)


POISON = [
    json.dumps({"id": "p-temp", "prompt_token_ids": [5, 6], "temperature": 10**400}),
    json.dumps({"id": "p-topk", "prompt_token_ids": [5, 6], "top_k": 2**40}),
    json.dumps({"id": "p-mint", "prompt_token_ids": [5], "max_tokens": 2**41, "min_tokens": 2**40}),
    json.dumps(
        {"id": "p-stop", "prompt_token_ids": [5], "min_tokens": 1, "stop_token_ids": [2**40]}
    ),
    json.dumps({"id": "p-surrogate", "prompt": "a\ud800b"}),
    '{"id": ' + "9" * 5000 + ', "prompt_token_ids": [5]}',
    '{"id": "p-deep", "prompt_token_ids": ' + "[" * 5000 + "]" * 5000 + "}",
]


@pytest.mark.slow  # 3 jax processes (+1 that exits at once): ~1 min wall on 2 busy cores
def test_two_writers_poison_rows_file_size_limit_and_changed_input(tmp_path):
    """A job with poison rows hits a file size limit (EFBIG, exit 5) while a second writer of the
    same output is refused (exit 3, naming the first one's pid); the input then changes (one
    finished row edited, a row inserted, a poison row fixed) and the rerun equals a fresh run of
    the new input, one row per id."""
    inp = real_input(tmp_path / "in.jsonl")
    lines = inp.read_text().splitlines()
    inp.write_text("\n".join(lines[:20] + POISON + lines[20:]) + "\n")
    out = tmp_path / "out.jsonl"
    # No compilation cache for the limited run: the limit applies to every file the child writes.
    first = start(inp, out, real_env(tmp_path, cache=False), max_file_bytes=6000)
    lock = Path(os.path.realpath(out) + ".lock")
    deadline = time.monotonic() + 120
    while not (lock.exists() and lock.read_text().strip() == str(first.pid)):
        assert first.poll() is None and time.monotonic() < deadline, first.stdout.read()
        time.sleep(0.05)
    second = start(inp, out, real_env(tmp_path))
    log2 = second.communicate(timeout=120)[0]
    assert first.poll() is None, "the first run ended before the second writer tried"
    assert second.returncode == 3, log2
    assert f"pid {first.pid}" in log2 and "another running job" in log2
    log1 = first.communicate(timeout=240)[0]
    assert first.returncode == 5, log1
    assert "file too large" in log1 and "rerun" in log1
    done = [r for r in read_complete(out) if r.get("error") is None]
    assert 0 < len(done) < 44, "the size limit should stop the run part way"

    # Change the input: edit a row that was done, insert a row, fix a poison row.
    lines = inp.read_text().splitlines()
    edited = done[0]["id"]
    for i, raw in enumerate(lines):
        if raw.startswith("{") and f'"id": "{edited}"' in raw:
            row = json.loads(raw)
            row["prompt_token_ids"] = row["prompt_token_ids"] + [77]
            lines[i] = json.dumps(row)
        if '"id": "p-topk"' in raw:
            lines[i] = '{"id": "p-topk", "prompt_token_ids": [5, 6], "top_k": 5}'
    lines.insert(0, '{"id": "inserted", "prompt_token_ids": [9, 8, 7], "max_tokens": 5}')
    inp.write_text("\n".join(lines) + "\n")
    ref_out = tmp_path / "reference.jsonl"
    reference = start(inp, ref_out, real_env(tmp_path))
    final = start(inp, out, real_env(tmp_path))
    log = final.communicate(timeout=240)[0]
    assert final.returncode == 0, log
    assert reference.wait(timeout=240) == 0, reference.stdout.read()
    assert "1 rows changed" in log and json.dumps(edited) in log

    got, want = by_key(read(out)), by_key(read(ref_out))  # by_key: one row per id
    assert set(got) == set(want) and len(want) == 46 + len(POISON) + 1
    for key, row in want.items():
        assert got[key] == row, key
    errors = {r["line"]: r["error"] for r in got.values() if r.get("error") is not None}
    assert len(errors) == 2 + len(POISON) - 1  # the malformed and long rows, the poison left
    assert got['"p-topk"'].get("error") is None and got['"inserted"'].get("error") is None
    for words in ("temperature", "top_k", "surrogate", "nested too deeply", "malformed JSON"):
        if words != "top_k":
            assert any(words in e for e in errors.values()), words


def read_complete(path: Path) -> list[dict]:
    """The rows of an output whose last line may be torn."""
    return [json.loads(x) for x in path.read_bytes().split(b"\n") if x.endswith(b"}")]
