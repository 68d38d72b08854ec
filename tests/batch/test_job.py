"""The job loop against a fake LLM: one output row per input row, in completion order, durable."""

from __future__ import annotations

import json
import signal

from batch_fakes import FakeLLM, FakeTokenizer, expected_text, expected_tokens
from test_reader import BAD_ROWS

from jaxserve.batch.job import StopFlag, output_row, run_job
from jaxserve.batch.reader import InputRow, read_input
from jaxserve.batch.resume import output_key, scan_output
from jaxserve.batch.summary import percentiles, summary, summary_path
from jaxserve.batch.writer import OutputWriter
from jaxserve.core.outputs import CompletionOutput, RequestMetrics, RequestOutput


def make_input(tmp_path, lines: list[bytes]) -> str:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return str(path)


def rows_key_of_broken(inp) -> str:
    return [r.key for r in read_input(inp) if r.error][0]


def run(tmp_path, inp, llm, **kw):
    rows = read_input(inp, sampling_defaults={"max_tokens": 4})
    out = str(tmp_path / "out.jsonl")
    with OutputWriter(out) as w:
        resume = w.open()
        skip = resume.plan(rows).skip
        stats = run_job(llm, rows, w, done_keys=skip, progress=False, **kw)
    return rows, stats, [json.loads(x) for x in open(out, encoding="utf-8")]


def test_every_bad_row_errors_and_the_rest_complete(tmp_path):
    lines = [b'{"id": "good-0", "prompt": "abc"}']
    for raw, _ in BAD_ROWS.values():
        lines += [raw, b'{"id": "good-%d", "prompt": "abc%d"}' % (len(lines), len(lines))]
    lines.append(b'{"id": "too-long", "prompt": "%s"}' % (b"x" * 65))  # fake max_model_len 64
    llm = FakeLLM(max_model_len=64)
    rows, stats, out = run(tmp_path, make_input(tmp_path, lines), llm, output_token_ids=True)

    assert len(out) == len(rows) == len(lines)
    by_line = {r["line"]: r for r in out}
    assert sorted(by_line) == list(range(1, len(lines) + 1))
    for i, (_, expected) in enumerate(BAD_ROWS.values()):
        row = by_line[2 + 2 * i]
        assert row["finish_reason"] == "error" and row["text"] is None
        for s in [f"line {2 + 2 * i}"] + expected[1:]:
            assert s in row["error"], (s, row["error"])
    too_long = by_line[len(lines)]
    assert too_long["id"] == "too-long"
    assert f"line {len(lines)}" in too_long["error"] and "max_model_len" in too_long["error"]
    good = [r for r in out if r["id"] and str(r["id"]).startswith("good-")]
    assert len(good) == len(BAD_ROWS) + 1
    for r in good:
        assert r.get("error") is None and r["finish_reason"] == "length"
        prompt = rows[r["line"] - 1].prompt.encode()
        assert r["text"] == expected_text(list(prompt), 4)
        assert r["token_ids"] == expected_tokens(list(prompt), 4)
        assert r["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 4}
    assert stats.num_ok == len(good) and stats.num_failed == len(BAD_ROWS) + 1
    assert stats.completion_tokens == 4 * len(good)
    # Only valid rows reached the engine; bad rows were written without it.
    assert len(llm.submitted) == len(good) + 1


def test_rows_are_written_in_completion_order(tmp_path):
    lines = [b'{"id": %d, "prompt": "p%d", "max_tokens": %d}' % (i, i, 5 - i) for i in range(5)]
    _, _, out = run(tmp_path, make_input(tmp_path, lines), FakeLLM())
    assert [r["id"] for r in out] == [4, 3, 2, 1, 0]  # shortest max_tokens finishes first


def test_resume_skips_done_rows(tmp_path):
    lines = [b'{"id": %d, "prompt": "p%d"}' % (i, i) for i in range(6)] + [b"{broken"]
    inp = make_input(tmp_path, lines)
    stop = StopFlag()
    llm = FakeLLM(per_step=3, on_output=lambda n: n == 1 and stop._handle(signal.SIGTERM, None))
    _, stats, out = run(tmp_path, inp, llm, stop=stop)
    # The bad row is written at once. The signal arrives after the 1st of the 3 outputs that
    # finished in the first step: all 3 are still written (none is redone), no step runs after.
    assert stats.num_ok == 3 and len(out) == 4 and llm.closed and llm.yielded == 3
    assert stop.requested and stop.name == "SIGTERM"
    llm2 = FakeLLM()
    _, stats2, out2 = run(tmp_path, inp, llm2)
    # The malformed row is not rewritten: the same bytes fail the same way.
    assert stats2.num_ok == 3 and stats2.num_failed == 0
    assert len(llm2.submitted) == 3  # only the rows not done before
    keys = [output_key(r) for r in out2]
    assert sorted(keys) == sorted([str(i) for i in range(6)] + [rows_key_of_broken(inp)])
    assert scan_output(str(tmp_path / "out.jsonl"), repair=False).repaired_bytes == 0


def test_chat_rows_use_the_template(tmp_path):
    lines = [
        b'{"id": "m", "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]}',
        b'{"id": "p", "prompt": "plain"}',
    ]
    inp = make_input(tmp_path, lines)
    llm = FakeLLM(max_model_len=256)
    run(tmp_path, inp, llm, tokenizer=FakeTokenizer(), use_chat_template=True)
    rendered = [bytes(p["prompt_token_ids"]).decode() for p in llm.submitted]
    assert sorted(rendered) == ["<system>S<user>U<assistant>", "<user>plain<assistant>"]
    # No tokenizer (or none with a template): the messages row fails alone.
    (tmp_path / "out.jsonl").unlink()
    _, _, out = run(tmp_path, inp, FakeLLM(), tokenizer=None)
    by_id = {r["id"]: r for r in out}
    assert "line 1" in by_id["m"]["error"] and "chat template" in by_id["m"]["error"]
    assert by_id["p"].get("error") is None


def test_summary_numbers(tmp_path):
    lines = [b'{"id": %d, "prompt": "p%d"}' % (i, i) for i in range(4)] + [b"{"]
    llm = FakeLLM()
    _, stats, _ = run(tmp_path, make_input(tmp_path, lines), llm)
    s = summary(
        stats,
        rows_in_shard=5,
        rows_done_before=0,
        ok_before=0,
        failed_before=0,
        interrupted=None,
        engine_stats=llm.stats(),
    )
    assert s["complete"] and s["rows"]["ok"] == 4 and s["rows"]["failed"] == 1
    assert s["this_run"]["completion_tokens"] == 16 and s["this_run"]["preemptions"] == 2
    assert s["this_run"]["ttft_s"]["p50"] in (0.02, 0.03)
    assert s["engine"]["kv_page_utilization"] == 0.25
    assert percentiles([]) is None
    p = percentiles([float(x) for x in range(1, 101)])
    assert (p["p50"], p["p90"], p["p99"], p["max"]) == (50.0, 90.0, 99.0, 100.0)
    assert summary_path("out/shard-3.jsonl") == "out/shard-3.summary.json"


def test_stop_flag_handles_signals_and_restores_handlers():
    before = signal.getsignal(signal.SIGTERM)
    stop = StopFlag()
    with stop.installed():
        assert signal.getsignal(signal.SIGINT) == stop._handle
        signal.raise_signal(signal.SIGINT)  # first: only sets the flag
        assert stop.requested and stop.name == "SIGINT" and 128 + stop.signum == 130
        try:
            signal.raise_signal(signal.SIGTERM)  # second: stop now
            raise AssertionError("a second signal must raise KeyboardInterrupt")
        except KeyboardInterrupt:
            pass
    assert signal.getsignal(signal.SIGTERM) == before


def test_output_row_with_logprobs_and_several_completions():
    row = InputRow(line=4, key='"x"', id="x", prompt="p")
    comps = [
        CompletionOutput(
            0, "ab", [97, 98], "stop", stop_reason=2, logprobs=[{97: -0.5}, {98: -1.0}]
        ),
        CompletionOutput(1, "c", [99], "length"),
    ]
    out = RequestOutput("0", "p", [112], comps, True, RequestMetrics(0.0))
    rec = output_row(row, out, token_ids=True)
    assert rec["text"] == "ab" and rec["stop_reason"] == 2 and rec["token_ids"] == [97, 98]
    assert rec["logprobs"] == [{"97": -0.5}, {"98": -1.0}]
    assert rec["usage"] == {"prompt_tokens": 1, "completion_tokens": 3}
    assert rec["choices"][1] == {"text": "c", "finish_reason": "length", "token_ids": [99]}
    json.dumps(rec)  # plain JSON all the way down
    failed = RequestOutput.from_error("1", "p", [112], "prompt too long", 0.0)
    assert output_row(row, failed)["error"] == "line 4: prompt too long"
