"""Repository contracts: CI runs README's test command verbatim; the suite's workers keep the tests
of a module-scoped fixture together, compile at LLVM -O0 unless asked not to, and share one
compilation cache per run."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(.*?)\n```", text, flags=re.S)


def test_ci_runs_readme_test_command():
    commands = _readme_commands()
    assert len(commands) >= 2, "README must start with the main-job and the test command"
    test_command = commands[1].strip()
    assert "pytest" in test_command
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in ci, f".ci/run does not run README's test command:\n{test_command}"


def test_main_job_uses_example_prompts():
    main = _readme_commands()[0]
    assert "jaxserve.launch.generate" in main
    for path in re.findall(r"--input (\S+)", main):
        assert (ROOT / path).exists(), path


def _pytest_with_repo_conftest(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """pytest -n 2 on the tests in tmp_path with this repo's conftest and pyproject settings, in
    an environment without XLA_FLAGS or a compilation cache (this suite's own run sets them)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and not k.startswith("JAX_")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", *args, "-n", "2", "-p", "conftest"]
        + ["-p", "no:cacheprovider", "-c", str(ROOT / "pyproject.toml")]
        + ["--rootdir", str(tmp_path), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env | {"PYTHONPATH": str(ROOT / "tests")},
        timeout=300,
    )


def test_tests_sharing_a_module_fixture_run_on_one_worker(tmp_path):
    """tests/conftest.py groups them and pyproject's addopts turn the groups on (--dist loadgroup);
    a pytest or xdist release that drops either silently builds each such fixture once per worker."""
    (tmp_path / "test_grouping.py").write_text(
        "import pytest\n\n"
        "@pytest.fixture(scope='module')\n"
        "def shared():\n    return 1\n\n"
        "@pytest.mark.parametrize('i', range(6))\n"
        "def test_shared(shared, i):\n    pass\n\n"
        "@pytest.mark.parametrize('i', range(6))\n"
        "def test_alone(i):\n    pass\n"
    )
    proc = _pytest_with_repo_conftest(tmp_path, "-v")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ran = re.findall(r"\[(gw\d)\].*PASSED \S*::(test_\w+)\[\d\](@\S+)?", proc.stdout)
    assert len(ran) == 12, proc.stdout[-3000:]
    shared = [(gw, group) for gw, name, group in ran if name == "test_shared"]
    assert len({gw for gw, _ in shared}) == 1 and all(group for _, group in shared), shared
    assert all(not group for _, name, group in ran if name == "test_alone")


@pytest.mark.parametrize("option, o0", [([], True), (["--xla-cpu-opt=default"], False)])
def test_the_suite_compiles_at_llvm_o0_unless_asked_not_to(tmp_path, option, o0):
    """tests/conftest.py puts LLVM -O0 into XLA_FLAGS in every xdist worker (and so into the
    subprocesses the tests start); `--xla-cpu-opt=default` (CI's run of the default_opt tests) leaves XLA's
    own level."""
    (tmp_path / "test_flags.py").write_text(
        "import os\n\n"
        "def test_flags():\n"
        "    flags = os.environ.get('XLA_FLAGS', '')\n"
        f"    assert ('--xla_backend_optimization_level=0' in flags) is {o0}, flags\n"
    )
    proc = _pytest_with_repo_conftest(tmp_path, "-q", *option)
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-3000:]


@pytest.mark.parametrize("option, cached", [([], True), (["--compile-cache=off"], False)])
def test_the_suite_shares_one_compilation_cache_per_run(tmp_path, option, cached):
    """tests/conftest.py gives a run one JAX persistent compilation cache, in a new directory that
    both xdist workers use and that is gone after the run; `--compile-cache=off` gives none."""
    (tmp_path / "test_cache.py").write_text(
        "import os\n\n"
        "import pytest\n\n"
        "@pytest.mark.parametrize('i', range(2))\n"
        "def test_cache(i, worker_id):\n"
        f"    with open({str(tmp_path)!r} + f'/{{worker_id}}.txt', 'w') as f:\n"
        "        f.write(str(os.environ.get('JAX_COMPILATION_CACHE_DIR')))\n"
    )
    proc = _pytest_with_repo_conftest(tmp_path, "-q", *option)
    assert proc.returncode == 0 and "2 passed" in proc.stdout, proc.stdout[-3000:]
    dirs = {p.read_text() for p in tmp_path.glob("gw*.txt")}
    if cached:
        assert len(dirs) == 1 and "jaxserve-test-xla-cache-" in next(iter(dirs)), dirs
        assert not pathlib.Path(next(iter(dirs))).exists()
    else:
        assert dirs == {"None"}, dirs


def test_the_packages_under_test_are_the_repositorys_not_the_tests_folders():
    """CI runs the venv's `pytest`, which puts `tests/` on sys.path (for model_testing.py) but not
    the repository root; `tests/pallas_kernels/` then shadowed the real package for modules two
    levels down (`pallas_kernels.attention.*`: 98 modules failed to import at ec957eb, JOURNAL.md
    60a). Every package of the repository, imported in a test, comes from the repository."""
    import importlib
    import pkgutil

    for top in ("jaxserve", "pallas_kernels", "cpu_kernels"):
        package = importlib.import_module(top)
        assert package.__file__ is not None, f"{top} imported as a namespace: {package.__path__}"
        for info in pkgutil.walk_packages(package.__path__, prefix=top + "."):
            if not info.ispkg:
                continue
            module = importlib.import_module(info.name)
            path = pathlib.Path(module.__file__ or "").resolve()
            assert module.__file__ and path.is_relative_to(ROOT / top), (info.name, module.__path__)
