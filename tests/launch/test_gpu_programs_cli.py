"""`python -m jaxserve.launch.gpu_programs`: the inspector's command line, end to end (a small
engine's slot-update programs and one decode program, compiled for an H100 here)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve.bench import deviceless

ROOT = Path(__file__).resolve().parents[2]


def test_prints_a_row_per_program_and_writes_the_reports(tmp_path):
    out = tmp_path / "r.jsonl"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxserve.launch.gpu_programs",
            "--model=smollm2-135m",
            "--num_slots=4",
            "--max_model_len=64",
            "--dtype=bfloat16",
            "--programs=decode,slots",
            "--select=i",  # 'insert', 'sync', 'set_grammar' and 'decode_forward ... width=...'
            "--limit=2",
            "--target=h200",
            f"--json_out={out}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "NVIDIA H200" in lines[0] and "xla_gpu_enable_command_buffer" in lines[0], lines[0]
    assert lines[1].startswith("program | compile_s | kernels/step | kernels/layer")
    reports = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["name"] for r in reports] == [x.split(" | ")[0] for x in lines[2:4]]
    decode = reports[0]
    assert decode["name"].startswith("decode_forward") and decode["per_layer"] > 0
    assert decode["weight_bytes_materialized"] == 0 and decode["host_round_trips"] == {}


def test_a_bad_target_is_named():
    with pytest.raises(ValueError, match="'a100' is neither"):
        deviceless.target("a100")
