"""Many hosts, on one machine: 2 processes x 2 CPU devices (jax.distributed over localhost, gloo
collectives) at tensor parallel 4 across both, on real checkpoints.

`python -m jaxserve.launch.generate --model=<HF folder>`: the output equals a one-process TP-1
run's; killing one process makes the other exit with an error naming the lost task within the
heartbeat timeout, and rerunning both resumes without losing or duplicating rows.

Every load path (HF safetensors in one file and sharded, GGUF, GGUF-native Q4_1 / Q8_0, orbax
checkpoints plain and INT4, quantize-at-load int4-rtn / int8 / fp8) builds `LLM` across the two
processes (`many_hosts_loads.py`, one pair of processes for all of them) and decodes what a
one-process TP-1 `LLM` decodes. The server refuses many processes with a message saying what to
run instead."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
from model_testing import GOLDEN_DIR

from jaxserve.launch import distributed

HERE = Path(__file__).parent
ENGINE = [
    f"--model={GOLDEN_DIR / 'llama'}",
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


# -- every load format across processes --------------------------------------------------------------
def _sharded_hf(src, dst):
    """`src`'s single safetensors file as two shards with the index HF writes for big models."""
    from safetensors.numpy import load_file, save_file

    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    index = {}
    for i, part in enumerate((names[::2], names[1::2])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, dst / fname, metadata={"format": "pt"})
        index.update(dict.fromkeys(part, fname))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    return dst


@pytest.fixture(scope="module")
def load_cases(tmp_path_factory):
    from gguf_testing import Q, convert, reference_dir

    from jaxserve.launch.convert import convert as convert_checkpoint

    d = tmp_path_factory.mktemp("loads")
    llama = GOLDEN_DIR / "llama"
    qwen3 = reference_dir(d, "qwen3")
    for name, qtype in (("f32", Q.F32), ("q4_1", Q.Q4_1), ("q8_0", Q.Q8_0)):
        convert(qwen3, d / f"qwen3.{name}.gguf", qtype)
    # INT4 on qwen3: its 128-wide row-parallel inputs leave 32 rows per device at T=4, one group
    # (llama's 64 leave 16, which no INT4 group size divides: refused, naming the weight)
    convert_checkpoint(llama, None, str(d / "orbax"), dtype="float32")
    convert_checkpoint(qwen3, "int4-rtn", str(d / "orbax-int4"), group_size=32, dtype="float32")
    cases = [
        {"name": "hf", "model": str(llama)},
        {"name": "hf-sharded", "model": str(_sharded_hf(llama, d / "llama-sharded"))},
        {"name": "gguf", "model": str(d / "qwen3.f32.gguf")},
        {
            "name": "gguf-native-q4_1",
            "model": str(d / "qwen3.q4_1.gguf"),
            "quantization": "gguf-native",
        },
        {
            "name": "gguf-native-q8_0",
            "model": str(d / "qwen3.q8_0.gguf"),
            "quantization": "gguf-native",
        },
        {"name": "orbax", "model": str(d / "orbax")},
        {"name": "orbax-int4", "model": str(d / "orbax-int4")},
        {"name": "hf+int4-rtn", "model": str(qwen3), "quantization": "int4-rtn"},
        {"name": "hf+int8", "model": str(llama), "quantization": "int8"},
        {"name": "hf+fp8", "model": str(llama), "quantization": "fp8"},
    ]
    path = d / "cases.json"
    path.write_text(json.dumps(cases))
    return path


# INT4 at load picks its group size for T (`quant.default_group_size`): 32 at T=4, where one
# device would take 128. Its one-process equal is the group-32 RTN checkpoint ('orbax-int4'), so
# the one-process reference does not run this case (its group-128 tokens are compared with nothing).
REFERENCE_OF = {"hf+int4-rtn": "orbax-int4"}


def _driver(cases, out, devices, log, *dist):
    flags = f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0"
    env = {**os.environ, "XLA_FLAGS": flags}
    cmd = [sys.executable, str(HERE / "many_hosts_loads.py"), str(cases), str(out), *dist]
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def test_every_load_format_across_two_processes_equals_one(load_cases, tmp_path):
    port = _port()
    logs = {k: open(tmp_path / f"{k}.log", "w") for k in ("ref", "p0", "p1")}
    cases = json.loads(load_cases.read_text())
    ref_cases = tmp_path / "ref_cases.json"
    ref_cases.write_text(json.dumps([c for c in cases if c["name"] not in REFERENCE_OF]))
    ref = _driver(ref_cases, tmp_path / "ref.json", 1, logs["ref"])
    pair = [
        _driver(
            load_cases, tmp_path / "tp4.json", 2, logs[f"p{i}"], f"127.0.0.1:{port}", "2", str(i)
        )
        for i in range(2)
    ]
    for name, p in (("ref", ref), ("p0", pair[0]), ("p1", pair[1])):
        assert p.wait(timeout=900) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    want = json.loads((tmp_path / "ref.json").read_text())
    got = json.loads((tmp_path / "tp4.json").read_text())
    names = [c["name"] for c in cases]
    assert list(got) == names
    assert list(want) == [n for n in names if n not in REFERENCE_OF]
    for name in names:
        ref = REFERENCE_OF.get(name, name)
        assert not isinstance(want[ref], str), f"{ref}, one process: {want[ref]}"
        assert not isinstance(got[name], str), f"{name}, two processes: {got[name]}"
        for w, g in zip(want[ref], got[name]):
            assert g["token_ids"] == w["token_ids"], name
            np.testing.assert_allclose(g["logprobs"], w["logprobs"], atol=2e-4, err_msg=name)


def test_the_server_refuses_many_processes_and_says_what_to_run():
    cmd = [sys.executable, "-m", "jaxserve.launch.serve", f"--model={GOLDEN_DIR / 'llama'}"]
    cmd += ["--coordinator_address=127.0.0.1:1", "--num_processes=2", "--process_id=0"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "serving over many processes is not supported" in run.stderr
    assert "run one server per host" in run.stderr
