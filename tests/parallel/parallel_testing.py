"""Runs `parallel_cases.py` in a subprocess with N host CPU devices and returns its results."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

CASES = Path(__file__).with_name("parallel_cases.py")


def run_cases(num_devices: int, names: list[str], timeout: float = 2400) -> dict:
    proc = subprocess.run(
        [sys.executable, str(CASES), str(num_devices), *names],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULTS ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"parallel cases failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULTS ") :])


def result(results: dict, name: str) -> dict:
    r = results[name]
    if "error" in r:
        raise AssertionError(f"case {name} raised:\n{r['error']}")
    return r
