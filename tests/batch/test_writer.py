"""Output file: durable appends, torn-last-line repair, resume sets, early path checks."""

from __future__ import annotations

import json
import os

import pytest

from jaxserve.batch.resume import output_key, scan_output
from jaxserve.batch.writer import OutputWriter, check_output_path


def rows(n, start=0):
    return [{"id": f"r{i}", "line": i + 1, "text": f"t{i}", "error": None} for i in range(start, n)]


def test_append_and_resume(tmp_path):
    path = str(tmp_path / "out.jsonl")
    with OutputWriter(path) as w:
        assert w.open().done_keys == set()
        for r in rows(3):
            w.write(r)
        w.write({"id": None, "line": 9, "error": "line 9: malformed JSON"})
    resume = scan_output(path, repair=False)
    assert resume.done_keys == {'"r0"', '"r1"', '"r2"'}  # an error row is not done: retried
    assert resume.failed_keys == {"line:9"}
    assert resume.repaired_bytes == 0
    # A second run appends; nothing is rewritten.
    with OutputWriter(path) as w:
        assert len(w.open().rows) == 4
        w.write(rows(4, 3)[0])
    lines = open(path, encoding="utf-8").read().splitlines()
    assert [json.loads(x)["line"] for x in lines] == [1, 2, 3, 9, 4]


@pytest.mark.parametrize(
    "tail",
    [
        b'{"id": "r3", "line": 4, "te',  # cut inside the JSON
        b'{"id": "r3", "line": 4, "text": "t3", "error": null}',  # whole JSON, newline missing
        b"\x00\x00\x00\x00",  # zero-filled block after a power loss
        b'{"id": "r3", "text": "caf\xc3',  # cut inside a UTF-8 character
    ],
)
def test_torn_last_line_is_detected_and_repaired(tmp_path, tail):
    path = tmp_path / "out.jsonl"
    good = b"".join(json.dumps(r).encode() + b"\n" for r in rows(3))
    path.write_bytes(good + tail)
    dry = scan_output(str(path), repair=False)
    assert dry.repaired_bytes == len(tail) and path.read_bytes() == good + tail
    with OutputWriter(str(path)) as w:
        resume = w.open()
        assert resume.repaired_bytes == len(tail)
        assert resume.done_keys == {'"r0"', '"r1"', '"r2"'}  # r3 is redone
        w.write(rows(4, 3)[0])
    assert path.read_bytes() == good + json.dumps(rows(4, 3)[0]).encode() + b"\n"


def test_corruption_before_the_last_line_is_refused(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"id": "a", "line": 1}\nGARBAGE\n{"id": "b", "line": 3}\n')
    with pytest.raises(ValueError, match="line 2 is (corrupt|not a jaxserve output row)"):
        OutputWriter(str(path)).open()
    assert path.read_bytes().count(b"\n") == 3  # untouched


def test_output_key_matches_input_keys():
    assert output_key({"id": 7, "line": 3}) == "7"
    assert output_key({"id": "7", "line": 3}) == '"7"'
    assert output_key({"id": None, "line": 3}) == "line:3"


def test_check_output_path(tmp_path):
    check_output_path(str(tmp_path / "new" / "dir" / "out.jsonl"))  # creates the directory
    assert (tmp_path / "new" / "dir" / "out.jsonl").exists()
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="cannot create output directory"):
        check_output_path(str(blocker / "out.jsonl"))
    with pytest.raises(ValueError, match="is a directory"):
        check_output_path(str(tmp_path))
    if os.geteuid() != 0:  # root may write anywhere; the blocker case above covers it there
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        with pytest.raises(ValueError, match="not writable"):
            check_output_path(str(locked / "out.jsonl"))
