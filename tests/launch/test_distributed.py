"""Many hosts, on one machine: 2 processes x 2 CPU devices (jax.distributed over localhost, gloo
collectives) run `python -m jaxserve.launch.generate` at tensor parallel 4 across both. The output
equals a one-process TP-1 run's; killing one process makes the other exit with an error naming
the lost task within the heartbeat timeout, and rerunning both resumes without losing or
duplicating rows."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import types

import pytest

from jaxserve.launch import distributed

ENGINE = [
    "--model=tiny",
    "--load_format=dummy",
    "--dtype=float32",
    "--num_slots=4",
    "--max_model_len=64",
    "--output_token_ids",
]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cmd(inp, out):
    return [sys.executable, "-m", "jaxserve.launch.generate", f"--input={inp}", f"--output={out}"]


def _start(inp, out, extra, devices, log):
    # XLA's CPU backend at LLVM -O0 in every run (the reference too): compiling is most of each
    # run's time, and -O0 leaves the programs' HLO, sharding and collectives unchanged
    flags = f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0"
    env = {**os.environ, "XLA_FLAGS": flags}
    cmd = [*_cmd(inp, out), *ENGINE, *extra]
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def _two_processes(inp, out, tmp_path, tag):
    port = _port()
    common = [
        "--tensor_parallel_size=4",
        f"--coordinator_address=127.0.0.1:{port}",
        "--num_processes=2",
        "--heartbeat_timeout_s=10",
    ]
    logs = [open(tmp_path / f"{tag}{i}.log", "w") for i in range(2)]
    procs = [_start(inp, out, [*common, f"--process_id={i}"], 2, logs[i]) for i in range(2)]
    return procs, logs


def _rows(path):
    return {r["id"]: r["token_ids"] for r in map(json.loads, open(path))}


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    d = tmp_path_factory.mktemp("dist")
    inp = d / "in.jsonl"
    with open(inp, "w") as f:
        for i in range(10):
            row = {"id": f"r{i}", "prompt_token_ids": [1 + i, 5, 9, 33, 7][: 2 + i % 4]}
            f.write(json.dumps({**row, "max_tokens": 6, "temperature": 0, "ignore_eos": True}))
            f.write("\n")
    return inp


def test_two_processes_match_one_then_survive_a_kill_and_resume(prompts, tmp_path):
    ref_out = tmp_path / "ref.jsonl"
    with open(tmp_path / "ref.log", "w") as log:
        ref = _start(prompts, ref_out, [], 1, log)
        assert ref.wait(timeout=600) == 0, (tmp_path / "ref.log").read_text()[-3000:]
    want = _rows(ref_out)
    assert len(want) == 10 and all(len(t) == 6 for t in want.values())

    out = tmp_path / "out.jsonl"
    procs, logs = _two_processes(prompts, out, tmp_path, "kill")
    deadline = time.monotonic() + 600
    while not (out.exists() and out.stat().st_size) and time.monotonic() < deadline:
        assert procs[0].poll() is None, (tmp_path / "kill0.log").read_text()[-3000:]
        time.sleep(0.1)
    procs[1].send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    rc = procs[0].wait(timeout=120)  # no hang: the collective or the heartbeat (10 s) fails it
    waited = time.monotonic() - t0
    log0 = (tmp_path / "kill0.log").read_text()
    assert rc != 0  # rows were left (each needs process 1's devices): it cannot have finished
    assert waited < 60, waited
    assert "Task 1" in log0 or "heartbeat" in log0 or "Connection reset" in log0, log0[-3000:]
    partial = _rows(out)
    assert partial and all(want[k] == v for k, v in partial.items())

    procs, logs = _two_processes(prompts, out, tmp_path, "resume")
    for i, p in enumerate(procs):
        assert p.wait(timeout=600) == 0, (tmp_path / f"resume{i}.log").read_text()[-3000:]
    lines = [json.loads(x) for x in open(out)]
    assert len(lines) == 10  # compacted: each row once
    assert _rows(out) == want


def test_the_three_flags_go_together():
    def flags(**kw):
        base = dict(coordinator_address=None, num_processes=None, process_id=None)
        return types.SimpleNamespace(**{**base, "distributed": False, **kw})

    assert not distributed.wanted(flags())
    assert distributed.wanted(flags(distributed=True))
    with pytest.raises(ValueError, match="go together"):
        distributed.wanted(flags(coordinator_address="127.0.0.1:1", num_processes=2))
    with pytest.raises(ValueError, match=r"--process_id=2 must be in \[0, --num_processes=2\)"):
        distributed.wanted(flags(coordinator_address="127.0.0.1:1", num_processes=2, process_id=2))
