"""Issue 24, the batch job: no row can sink the job, the output is safe, resume is keyed by content.

Each case is a row or a fault a hostile user (or a SLURM requeue) produced; every one crashed the
job, hung it, or silently kept a wrong answer before this file existed.
"""

from __future__ import annotations

import errno
import json
import os
import threading
import time

import pytest
from batch_fakes import FakeLLM, FakeTokenizer, expected_text

from jaxserve.batch.errors import NotAnOutput, OutputError, OutputLocked
from jaxserve.batch.job import render_prompt, run_job
from jaxserve.batch.merge import merge_outputs
from jaxserve.batch.reader import InputRow, read_input
from jaxserve.batch.resume import output_key, scan_output
from jaxserve.batch.writer import OutputWriter, check_output_path, encode_row

DEEP = b'{"id": "deep", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
# (raw line, substrings of its error). Every case runs in one file between good rows.
POISON_ROWS = {
    "temperature_10e400": (
        b'{"id": "t", "prompt": "x", "temperature": 1' + b"0" * 400 + b"}",
        ["temperature", "too large"],
    ),
    "top_k_2e40": (b'{"id": "k", "prompt": "x", "top_k": %d}' % 2**40, ["top_k", "2**31"]),
    "min_tokens_2e40": (
        b'{"id": "mt", "prompt": "x", "max_tokens": %d, "min_tokens": %d}' % (2**41, 2**40),
        ["max_tokens", "2**31"],
    ),
    "stop_token_id_2e40": (
        b'{"id": "s", "prompt": "x", "stop_token_ids": [%d]}' % 2**40,
        ["stop_token_ids", "2**31"],
    ),
    "token_id_2e40": (b'{"id": "ti", "prompt_token_ids": [%d]}' % 2**40, ["prompt_token_ids"]),
    "surrogate_prompt": (b'{"id": "sp", "prompt": "a\\ud800b"}', ["prompt", "surrogate"]),
    "surrogate_id": (b'{"id": "\\udc80", "prompt": "x"}', ["id", "surrogate"]),
    "surrogate_message": (
        b'{"id": "sm", "messages": [{"role": "user", "content": "\\ud83d"}]}',
        ["messages[0].content", "surrogate"],
    ),
    "id_5000_digits": (b'{"id": ' + b"7" * 5000 + b', "prompt": "x"}', ["malformed JSON"]),
    "id_above_int64": (b'{"id": %d, "prompt": "x"}' % 2**70, ["'id'", "2**63"]),
    "nested_5000_deep": (DEEP, ["malformed JSON", "nested too deeply"]),
}


def write_input(tmp_path, lines: list[bytes], name="in.jsonl", ending=b"\n") -> str:
    path = tmp_path / name
    path.write_bytes(ending.join(lines) + ending)
    return str(path)


def run(inp, out, llm, tokenizer=None, **kw):
    rows = read_input(inp, sampling_defaults={"max_tokens": 4})
    with OutputWriter(str(out)) as w:
        plan = w.open().plan(rows)
        stats = run_job(
            llm, rows, w, done_keys=plan.skip, progress=False, tokenizer=tokenizer, **kw
        )
    return rows, stats, plan


def read(path) -> list[dict]:
    data = open(path, "rb").read()
    data.decode("utf-8")  # strict: the output is valid UTF-8
    return [json.loads(x) for x in data.splitlines()]


# -- 1. no row can crash the job or lose another's result --------------------------------------


def test_poison_rows_each_become_their_own_error_row(tmp_path):
    lines = []
    for i, (raw, _) in enumerate(POISON_ROWS.values()):
        lines += [b'{"id": "good-%d", "prompt": "abc%d"}' % (i, i), raw]
    inp = write_input(tmp_path, lines)
    llm = FakeLLM(tokenizer=FakeTokenizer())
    rows, stats, _ = run(inp, tmp_path / "out.jsonl", llm, tokenizer=FakeTokenizer())
    out = read(tmp_path / "out.jsonl")
    assert len(out) == len(lines) and stats.num_ok == len(POISON_ROWS)
    by_line = {r["line"]: r for r in out}
    for i, (case, (_, expected)) in enumerate(POISON_ROWS.items()):
        good, bad = by_line[2 * i + 1], by_line[2 * i + 2]
        assert good.get("error") is None
        assert good["text"] == expected_text(list(b"abc%d" % i), 4), case
        assert bad["finish_reason"] == "error", (case, bad)
        for s in [f"line {2 * i + 2}", *expected]:
            assert s in bad["error"], (case, s, bad["error"])
    assert len(llm.submitted) == len(POISON_ROWS)  # no poison row reached the engine


def test_a_row_the_tokenizer_rejects_fails_alone(tmp_path):
    class Picky(FakeTokenizer):
        def __call__(self, text, add_special_tokens=True):
            if "boom" in text:
                raise TypeError("TextEncodeInput must be Union[TextInputSequence, ...]")
            return super().__call__(text, add_special_tokens)

    inp = write_input(tmp_path, [b'{"id": 1, "prompt": "ok"}', b'{"id": 2, "prompt": "boom"}'])
    llm = FakeLLM(tokenizer=Picky())
    run(inp, tmp_path / "out.jsonl", llm, tokenizer=Picky())
    by_id = {r["id"]: r for r in read(tmp_path / "out.jsonl")}
    assert by_id[1]["text"] == expected_text(list(b"ok"), 4)
    assert "line 2" in by_id[2]["error"] and "TypeError" in by_id[2]["error"]


class LoopingTemplate(FakeTokenizer):
    """A chat template that never ends for one row (a model's chat_template.jinja can do that)."""

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        if messages[-1]["content"] == "loop":
            while True:
                pass
        if messages[-1]["content"] == "huge":
            return "x" * 10_000
        return super().apply_chat_template(messages, tokenize, add_generation_prompt)


def test_a_chat_template_that_loops_forever_fails_its_row_only(tmp_path):
    lines = [
        b'{"id": "a", "messages": [{"role": "user", "content": "hi"}]}',
        b'{"id": "b", "messages": [{"role": "user", "content": "loop"}]}',
        b'{"id": "c", "messages": [{"role": "user", "content": "huge"}]}',
    ]
    inp = write_input(tmp_path, lines)
    t0 = time.monotonic()
    run(
        inp,
        tmp_path / "out.jsonl",
        FakeLLM(max_model_len=256),
        tokenizer=LoopingTemplate(),
        render_timeout_s=0.3,
        render_max_chars=1000,
    )
    assert time.monotonic() - t0 < 5
    by_id = {r["id"]: r for r in read(tmp_path / "out.jsonl")}
    assert by_id["a"].get("error") is None
    assert "line 2" in by_id["b"]["error"] and "over 0.3 s" in by_id["b"]["error"]
    assert "10000 characters, over 1000" in by_id["c"]["error"]


def test_a_jinja_template_that_loops_is_bounded_in_a_worker_thread_too():
    import jinja2.sandbox

    env = jinja2.sandbox.ImmutableSandboxedEnvironment()
    forever = env.from_string(
        "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
    )

    class JinjaTokenizer(FakeTokenizer):
        chat_template = "loops"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return forever.render(messages=messages)

    row = InputRow(1, '"x"', "x", messages=[{"role": "user", "content": "hi"}])
    errors = []

    def worker():
        try:
            render_prompt(row, JinjaTokenizer(), False, timeout_s=0.3)
        except BaseException as e:
            errors.append(type(e).__name__)

    t0 = time.monotonic()
    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(10)
    assert not thread.is_alive() and errors == ["RenderTimeout"]
    assert time.monotonic() - t0 < 5


def test_the_writer_writes_valid_utf8_for_any_string(tmp_path):
    row = {"id": "x", "line": 1, "text": "model said \udcff here", "finish_reason": "stop"}
    data = encode_row(row)
    data.decode("utf-8")
    assert json.loads(data)["text"] == row["text"]
    with OutputWriter(str(tmp_path / "o.jsonl")) as w:
        w.open()
        w.write(row)
    assert read(tmp_path / "o.jsonl")[0]["text"] == row["text"]


# -- 2. the output is safe ----------------------------------------------------------------------


def test_a_second_writer_fails_at_once_naming_the_holder(tmp_path):
    out = tmp_path / "out.jsonl"
    link = tmp_path / "link.jsonl"
    with OutputWriter(str(out)) as first:
        first.open()
        link.symlink_to(out)
        for path in (out, link):
            with pytest.raises(OutputLocked, match=f"pid {os.getpid()}") as e:
                OutputWriter(str(path)).open()
            assert e.value.exit_code == 3
    with OutputWriter(str(out)) as again:  # released on close
        again.open()


def test_output_that_is_the_input_is_refused(tmp_path):
    inp = write_input(tmp_path, [b'{"id": 1, "prompt": "x"}'])
    (tmp_path / "sym.jsonl").symlink_to(inp)
    os.link(inp, tmp_path / "hard.jsonl")
    for out in (inp, tmp_path / "sym.jsonl", tmp_path / "hard.jsonl"):
        with pytest.raises(OutputError, match="is the input file"):
            check_output_path(str(out), inp)
    assert open(inp, "rb").read() == b'{"id": 1, "prompt": "x"}\n'


@pytest.mark.parametrize("content", [b"my notes about the run\n", b"[1, 2]\n", b'"x"\n'])
def test_an_existing_file_that_is_not_an_output_is_refused_unless_overwrite(tmp_path, content):
    out = tmp_path / "notes.jsonl"
    out.write_bytes(content)
    with pytest.raises(NotAnOutput, match="not a jaxserve output|corrupt|not JSON"):
        OutputWriter(str(out)).open()
    assert out.read_bytes() == content  # untouched (it used to be cut off as a "torn line")
    with OutputWriter(str(out), overwrite=True) as w:
        assert w.open().rows == {}
    assert out.read_bytes() == b""


@pytest.mark.parametrize(
    "content",
    [b"one line of prose, no newline", b"\x00\x00\x00\x00", b'{"note": 1}'],
)
def test_a_file_of_one_unterminated_line_that_is_not_ours_is_not_cut(tmp_path, content):
    """Issue 58: a user's file of one line without a trailing newline looked like the torn last
    line a crash leaves, and was cut to nothing. A torn line is cut only in a file the job can
    show it wrote: one holding an output row, or whose only line begins as an output row."""
    out = tmp_path / "notes.txt"
    out.write_bytes(content)
    with pytest.raises(NotAnOutput, match="notes.txt.*not a jaxserve output"):
        OutputWriter(str(out)).open()
    assert out.read_bytes() == content


@pytest.mark.parametrize("torn", [b'{"id": "r0", "line": 1, "te', b'{"i'])
def test_a_torn_first_row_of_ours_is_still_repaired(tmp_path, torn):
    out = tmp_path / "out.jsonl"
    out.write_bytes(torn)  # the job died while writing its first row
    with OutputWriter(str(out)) as w:
        assert w.open().repaired_bytes == len(torn)
    assert out.read_bytes() == b""


def test_non_regular_outputs_are_refused_without_blocking(tmp_path):
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    for path in (str(fifo), "/dev/full", "/dev/null"):
        with pytest.raises(OutputError, match="not a regular file"):
            check_output_path(path)


@pytest.mark.parametrize(
    "err, code, words",
    [
        (errno.ENOSPC, 4, "disk full"),
        (errno.EFBIG, 5, "file too large"),
        (errno.EACCES, 6, "permission denied"),
        (errno.EIO, 7, "Errno 5"),
    ],
)
def test_write_errors_stop_the_job_with_a_code_and_a_rerun_resumes(
    tmp_path, monkeypatch, err, code, words
):
    inp = write_input(tmp_path, [b'{"id": %d, "prompt": "p%d"}' % (i, i) for i in range(6)])
    out = tmp_path / "out.jsonl"
    real_write, calls = os.write, []

    def failing_write(fd, data):
        calls.append(fd)
        if len(calls) == 3:  # half of the row reaches the disk, then the error
            real_write(fd, bytes(data)[: len(data) // 2])
            raise OSError(err, os.strerror(err))
        return real_write(fd, data)

    monkeypatch.setattr("jaxserve.batch.writer.os.write", failing_write)
    with pytest.raises(OutputError, match=words) as e:
        run(inp, out, FakeLLM())
    assert e.value.exit_code == code and "rerun" in str(e.value)
    monkeypatch.undo()
    resume = scan_output(str(out), repair=False)
    assert len(resume.done_keys) == 2 and resume.repaired_bytes > 0  # the torn half row
    _, stats, plan = run(inp, out, FakeLLM())
    assert len(plan.skip) == 2 and stats.num_ok == 4
    assert sorted(output_key(r) for r in read(out)) == [str(i) for i in range(6)]


# -- 3. resume keyed by content -----------------------------------------------------------------


def test_a_changed_row_is_redone_and_error_rows_are_retried(tmp_path, caplog):
    out = tmp_path / "out.jsonl"
    v1 = [
        b'{"id": "a", "prompt": "first"}',
        b'{"id": "b", "prompt": "same"}',
        b'{"id": "long", "prompt": "%s"}' % (b"y" * 80),  # fails in the engine (max_model_len)
        b'{"id": "fixme", "prompt": "x", "top_p": 7}',  # a bad row, fixed in v2
    ]
    run(write_input(tmp_path, v1, "v1.jsonl"), out, FakeLLM(max_model_len=64))
    v2 = [v1[0].replace(b"first", b"edited"), v1[1], v1[2], b'{"id": "fixme", "prompt": "x"}']
    llm = FakeLLM(max_model_len=256)
    _, _, plan = run(write_input(tmp_path, v2, "v2.jsonl"), out, llm, tokenizer=FakeTokenizer())
    assert plan.skip == {'"b"'} and plan.changed == ['"a"']
    assert sorted(plan.retried) == ['"fixme"', '"long"']
    assert sorted(bytes(p["prompt_token_ids"])[:6] for p in llm.submitted) == [
        b"edited",
        b"x",
        b"yyyyyy",
    ]
    last = {}
    for r in read(out):  # the last row of each key wins until the file is compacted
        last[output_key(r)] = r
    assert last['"a"']["text"] == expected_text(list(b"edited"), 4)
    assert last['"long"'].get("error") is None and last['"fixme"'].get("error") is None


def test_plain_text_keys_follow_content_not_line_numbers(tmp_path):
    out = tmp_path / "out.jsonl"
    run(write_input(tmp_path, [b"alpha", b"bravo", b"alpha"], "p.txt"), out, FakeLLM())
    llm = FakeLLM()
    # A line inserted at the top, and a line ending changed: no answer moves to another prompt.
    path = write_input(tmp_path, [b"zulu", b"alpha", b"bravo", b"alpha"], "p.txt", b"\r\n")
    rows, _, plan = run(path, out, llm)
    assert len(plan.skip) == 3 and len(llm.submitted) == 1
    assert rows[0].id != rows[2].id and rows[1].id + "#2" == rows[3].id
    prompts = {r.key: r.prompt for r in rows}
    for r in read(out):
        assert r["text"] == expected_text(list(prompts[output_key(r)].encode()), 4)


@pytest.mark.parametrize("ending", [b"\n", b"\r\n", b"\r"])
def test_bom_and_every_line_ending(tmp_path, ending):
    lines = [b'{"id": %d, "prompt": "p%d"}' % (i, i) for i in range(3)]
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + ending.join(lines) + ending)
    rows = read_input(str(path))
    assert [(r.id, r.prompt, r.error) for r in rows] == [(i, f"p{i}", None) for i in range(3)]
    text = tmp_path / "in.txt"
    text.write_bytes(b"\xef\xbb\xbfone" + ending + b"two")
    assert [r.prompt for r in read_input(str(text))] == ["one", "two"]


# -- 4. merge ------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [b"[1, 2]\n", b'"x"\n', b"null\n"])
@pytest.mark.parametrize("where", ["last", "middle"])
def test_merge_names_a_non_object_row(tmp_path, bad, where):
    good = b'{"id": "q0", "line": 1, "text": "t", "finish_reason": "stop"}\n'
    shard = tmp_path / "shard.jsonl"
    shard.write_bytes(good + bad if where == "last" else bad + good)
    with pytest.raises(ValueError, match=r"shard.jsonl' line \d is not a jaxserve output row"):
        merge_outputs([str(shard)], str(tmp_path / "all.jsonl"))


def test_an_output_row_json_cannot_hold_fails_that_row_only(tmp_path):
    class OddLLM(FakeLLM):
        def _run(self, i, prompt, sp):
            out = super()._run(i, prompt, sp)
            if i == 0:
                out.outputs[0].logprobs = [{1: object()}]  # nothing JSON can encode
            return out

    inp = write_input(tmp_path, [b'{"id": "a", "prompt": "x"}', b'{"id": "b", "prompt": "y"}'])
    _, stats, _ = run(inp, tmp_path / "out.jsonl", OddLLM())
    by_id = {r["id"]: r for r in read(tmp_path / "out.jsonl")}
    assert "output row failed: TypeError" in by_id["a"]["error"]
    assert by_id["b"]["text"] == expected_text(list(b"y"), 4)
    assert stats.num_ok == 1 and stats.num_failed == 1
