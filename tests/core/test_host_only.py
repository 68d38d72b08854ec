"""jaxserve/core/ and jaxserve/inputs/ are host only: importing all of them (and the host-side
config and resolve modules core uses) loads neither jax nor flax. Runs in a fresh interpreter so no other test's imports count."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import jaxserve.core
import jaxserve.inputs

CORE_MODULES = sorted(
    f"{pkg.__name__}.{m.name}"
    for pkg in (jaxserve.core, jaxserve.inputs)
    for m in pkgutil.iter_modules(pkg.__path__)
)


def test_core_imports_no_jax():
    for m in ("core.engine", "core.scheduler", "core.request", "inputs.prompts", "inputs.chat"):
        assert f"jaxserve.{m}" in CORE_MODULES, m
    modules = [*CORE_MODULES, "jaxserve.config", "jaxserve.resolve", "jaxserve.testing.fake_runner"]
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in modules)
        + "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax'))\n"
        + "assert not bad, bad\n"
        + "print('ok', len(sys.modules))\n"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("ok")
