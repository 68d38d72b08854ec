"""The prepared GPU scripts run end to end in their --smoke mode (tiny shapes, interpret mode).

A lent H200 gives a session 15 minutes; a script that breaks there wastes them. These runs keep
`experiments/gpu_int4.py` and `experiments/gpu_kernels.py` working on the CPU between loans: every
step runs (checks, timings, tables, JSON), only the shapes and the backend differ.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "script,checks",
    [("gpu_int4.py", ("check", "stack")), ("gpu_kernels.py", ("correctness", "large_pools"))],
)
def test_gpu_script_smoke(tmp_path, script, checks):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / script), "--smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads((tmp_path / script.replace(".py", ".json")).read_text())
    assert out["smoke"] is True
    for part in checks:  # each check row says ok (or, for the stack timing, the same output)
        assert out[part] and all(c.get("ok", c.get("same")) for c in out[part]), part
