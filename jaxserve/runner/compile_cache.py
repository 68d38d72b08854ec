"""JAX's persistent compilation cache, on by default for every engine (`EngineConfig.compilation_cache`).

    directory(setting) -> str | None     where the cache goes ('auto', a path, or 'off' -> None;
                                         None too where the user turned jax's cache off)
    enable(setting) -> str | None        turns it on for this process (unless jax has one already)
    autotune_dir(setting) -> str | None  XLA:GPU's autotuning results, beside the programs

A GPU engine's warm-up compiles tens of programs (65 in 97 s for SmolLM2 on the H200, JOURNAL.md
48d); the cache makes every later start load them (on this CPU: 31 s of compiling became 1.4 s,
JOURNAL.md 48g). jax keeps it off unless told a directory, so the engine tells it one: a
`jaxserve/xla` folder in the user's cache directory. A directory the user set (the
JAX_COMPILATION_CACHE_DIR variable, `jax.config.update`) is kept, and so is the cache turned off
(JAX_ENABLE_COMPILATION_CACHE=false). jax decides whether to use the
cache at its first compilation; the engine may be built after a notebook compiled something, so
`enable` resets jax's decision once it has set the directory.

On GPU the same folder holds XLA's per-fusion autotuning results (`autotune_dir`, passed with the
engine's compiler options): a program missing from the compilation cache (a new shape) still
skips autotuning the fusions it shares with earlier ones.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache

logger = logging.getLogger(__name__)


def default_directory() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jaxserve" / "xla"


def directory(setting: str) -> str | None:
    """The folder `setting` names: 'auto' -> jax's own if set, else `default_directory()`;
    'off' -> None; any other text -> that path. None too where the user turned jax's cache off
    (JAX_ENABLE_COMPILATION_CACHE=false)."""
    if setting == "off" or not jax.config.jax_enable_compilation_cache:
        return None
    if setting == "auto":
        return jax.config.jax_compilation_cache_dir or str(default_directory())
    return os.path.expanduser(setting)


def enable(setting: str) -> str | None:
    """Turns the persistent cache on in `directory(setting)` (see the module docstring); returns
    the folder, or None when `setting` is 'off' or the folder cannot be made."""
    path = directory(setting)
    if path is None:
        return None
    if jax.config.jax_compilation_cache_dir == path:
        return path
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        logger.warning("compilation cache off: cannot make %s (%s)", path, e)
        return None
    compilation_cache.set_cache_dir(path)
    compilation_cache.reset_cache()  # jax may have decided "no cache" at an earlier compile
    logger.info("persistent compilation cache: %s", path)
    return path


def autotune_dir(setting: str) -> str | None:
    """Where XLA:GPU keeps per-fusion autotuning results: a folder beside the compiled programs of
    `directory(setting)` (None where there are none, or the folder cannot be made)."""
    cache_dir = directory(setting)
    if cache_dir is None:
        return None
    path = Path(cache_dir) / "autotune"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        logger.warning("autotuning cache off: cannot make %s (%s)", path, e)
        return None
    return str(path)
