"""`runner/compile_cache.py`: every engine turns jax's persistent compilation cache on, where the
user has not chosen otherwise (EngineConfig.compilation_cache)."""

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(code: str, env: dict) -> str:
    """Runs `code` in a fresh process (jax's cache settings are per process) -> its stdout."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


ENGINE = """
    import jax, jax.numpy as jnp
    jax.jit(lambda x: x + 1)(jnp.ones(3))  # a notebook compiled something first
    from jaxserve import LLM
    llm = LLM("tiny", load_format="dummy", dtype="float32", num_slots=2, max_model_len=32{extra})
    llm.generate([[1, 2, 3]])
    print(llm.engine.runner.compilation_cache_dir)
"""


def _env(tmp_path, **extra):
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env.pop("JAX_ENABLE_COMPILATION_CACHE", None)
    env.update(XDG_CACHE_HOME=str(tmp_path / "home-cache"), **extra)
    # keep every program (this test's are fast to compile)
    env.update(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    return env


def test_auto_puts_programs_in_the_user_cache_even_after_an_earlier_compile(tmp_path):
    out = run(ENGINE.format(extra=""), _env(tmp_path))
    cache = tmp_path / "home-cache" / "jaxserve" / "xla"
    assert out == str(cache)
    assert any(cache.iterdir()), "no program was written to the cache"


def test_a_directory_jax_already_has_is_kept(tmp_path):
    mine = tmp_path / "mine"
    out = run(ENGINE.format(extra=""), _env(tmp_path, JAX_COMPILATION_CACHE_DIR=str(mine)))
    assert out == str(mine) and any(mine.iterdir())
    assert not (tmp_path / "home-cache").exists()


def test_off_and_a_disabled_cache_leave_jax_alone(tmp_path):
    out = run(ENGINE.format(extra=', compilation_cache="off"'), _env(tmp_path))
    assert out == "None"
    env = _env(tmp_path, JAX_ENABLE_COMPILATION_CACHE="false")
    assert run(ENGINE.format(extra=""), env) == "None"
    assert not (tmp_path / "home-cache").exists()


def test_a_path_setting_is_used(tmp_path):
    there = tmp_path / "there"
    out = run(ENGINE.format(extra=f', compilation_cache="{there}"'), _env(tmp_path))
    assert out == str(there) and any(there.iterdir())
