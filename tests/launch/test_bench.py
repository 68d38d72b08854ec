"""`python -m jaxserve.launch.bench`: a real run of the tiny dummy model end to end, the summary's
fields, no compilation after warm-up, and the steady-state arithmetic on hand-made steps."""

from __future__ import annotations

import json

import pytest
from absl import app, flags

from jaxserve.bench.workloads import make_workload
from jaxserve.launch import bench

FLAGS = flags.FLAGS
TINY = ["--model=tiny", "--load_format=dummy", "--dtype=float32", "--page_size=128"]


@pytest.fixture
def run_main():
    def run(*args):
        FLAGS.unparse_flags()
        FLAGS(["bench", *args])
        try:
            return bench.main(["bench"])
        finally:
            FLAGS.unparse_flags()

    return run


def test_static_run_end_to_end(run_main, tmp_path, capsys):
    out = tmp_path / "s.json"
    args = ["--workload=longtail-small", "--num_requests=5", "--num_slots=2", "--batching=static"]
    rc = run_main(*TINY, *args, "--max_model_len=256", f"--summary_json={out}")
    assert rc == 0
    s = json.loads(out.read_text())
    w = make_workload("longtail-small", vocab_size=128, num_requests=5)
    assert s["batching"] == s["engine_config"]["batching"] == "static"
    assert s["num_slots"] == 2 and s["num_requests"] == 5 and s["num_errors"] == 0
    assert s["num_length_mismatches"] == 0
    assert s["output_tokens"] == w.total_output_tokens
    assert s["timed_compiles"] == 0  # warm-up compiled every shape
    assert s["warmup_compiles"] > 0
    assert s["output_tokens_per_s"] == pytest.approx(s["output_tokens"] / s["elapsed_s"])
    assert 0 < s["host_cpu_s"] <= s["cpu_s"]
    assert s["host_cpu_share"] == pytest.approx(s["host_cpu_s"] / s["cpu_s"])
    for key in ("ttft_s", "tpot_s"):
        p = s[key]
        assert 0 <= p["p50"] <= p["p90"] <= p["p99"]
    assert 0 < s["mean_slot_occupancy"] <= 1
    assert 0 < s["kv_page_utilization"] <= 1
    assert len(s["requests"]) == 5 and len(s["steps"]) == s["num_steps"]
    # Static batching: no request of the second batch starts before the first batch is done.
    first_batch_end = max(r["finished_s"] for r in s["requests"][:2])
    assert all(r["first_token_s"] >= first_batch_end for r in s["requests"][2:4])
    table = capsys.readouterr().out
    assert "output tokens/s" in table and "TTFT p50/p90/p99 ms" in table


def test_workload_longer_than_max_model_len_is_rejected(run_main):
    with pytest.raises(app.UsageError, match="max_model_len"):
        run_main(*TINY, "--workload=uniform", "--num_requests=2", "--max_model_len=128")


def test_unknown_workload_is_a_flag_error():
    with pytest.raises(flags.IllegalFlagValueError, match="workload"):
        FLAGS(["bench", "--workload=nope"])
    FLAGS.unparse_flags()
