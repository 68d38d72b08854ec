"""Building the C++ CPU kernels (`cpu_kernels/build.py`): with no compiler each kernel says why it
is not available (the engine then stays on its XLA paths: tests/runner/test_runner.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["paged_decode_attention", "matmul"])
def test_a_missing_compiler_is_a_clear_error(module, tmp_path):
    """A fresh process: a kernel's build is loaded once per process."""
    code = f"from cpu_kernels import {module} as m; print(m.available()); print(m.build_error())"
    env = {**os.environ, "CXX": "no-such-compiler", "JAXSERVE_CACHE_DIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out[0] == "False"
    assert f"{module}.cc" in out[1] and "no C++ compiler 'no-such-compiler'" in out[1]


def test_the_build_is_keyed_by_its_march(monkeypatch):
    """Another -march is another library (the portable paths are built beside the native ones)."""
    from cpu_kernels.build import Library

    lib = Library("matmul.cc")
    native = lib.path()
    monkeypatch.setenv("JAXSERVE_CPU_KERNELS_MARCH", "x86-64-v3")
    assert lib.path() != native and "-march=x86-64-v3" in lib.flags()
