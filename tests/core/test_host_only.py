"""jaxserve/core/ is host only: importing all of it (and the host-side config and resolve modules
it uses) loads neither jax nor flax. Runs in a fresh interpreter so no other test's imports count."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import jaxserve.core

CORE_MODULES = sorted(
    f"jaxserve.core.{m.name}" for m in pkgutil.iter_modules(jaxserve.core.__path__)
)


def test_core_imports_no_jax():
    assert {"jaxserve.core.engine", "jaxserve.core.scheduler", "jaxserve.core.request"} <= set(
        CORE_MODULES
    )
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
