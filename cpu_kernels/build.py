"""Compiling and loading a kernel's C++ source on first use (every kernel of this package).

    lib = Library("matmul.cc")
    lib.load()      -> the ctypes library (compiled first if needed); raises BuildError
    lib.error()     -> None when it loads here, else why not
    source_at_revision("HEAD~1", "matmul.cc") -> a temporary copy of that source at a git
                       revision (kernel A/B experiments build it as its own FFI target)

The source is compiled by the system C++ compiler (`$CXX`, default g++) with `-O3 -march=native`
(`$JAXSERVE_CPU_KERNELS_MARCH` overrides native) against jaxlib's FFI headers, into `$JAXSERVE_CACHE_DIR/cpu_kernels/` (default ~/.cache/jaxserve),
keyed by the source, the compiler, the flags, jaxlib's version and this CPU. Concurrent builds
(pytest-xdist workers, data-parallel launches) are safe: each compiles to a temporary name, then
renames it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax

CXXFLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp-simd", "-w")


def march() -> str:
    """The -march the kernels are built for: $JAXSERVE_CPU_KERNELS_MARCH (e.g. x86-64-v3, to
    build and test the portable paths on a CPU that has more), default native."""
    return os.environ.get("JAXSERVE_CPU_KERNELS_MARCH") or "native"


class BuildError(RuntimeError):
    """A kernel could not be compiled or loaded here."""


def _cpu_key() -> str:
    """What -march=native depends on: the CPU's model name and flags (Linux), else the arch."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
        return "\n".join(lines[:2])
    except OSError:
        return platform.machine()


def _cache_dir() -> Path:
    root = os.environ.get("JAXSERVE_CACHE_DIR") or os.path.join("~", ".cache", "jaxserve")
    return Path(root).expanduser() / "cpu_kernels"


class Library:
    """One C++ source file of this package, compiled once per key and loaded once per process."""

    def __init__(self, source: str | Path):
        self.source = Path(__file__).parent / source  # a file of this package, or a path
        self._loaded: ctypes.CDLL | str | None = None  # the library, or why it does not load

    def path(self) -> Path:
        """Where the compiled library for this source, compiler, flags, jaxlib and CPU lives."""
        import jaxlib

        cxx = os.environ.get("CXX", "g++")
        key = "\n".join(
            [
                self.source.read_text(),
                cxx,
                " ".join(self.flags()),
                jaxlib.__version__,
                _cpu_key(),
            ]
        )
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        return _cache_dir() / f"{self.source.stem}-{digest}.so"

    def flags(self) -> list[str]:
        return [f"-march={march()}", *CXXFLAGS]

    def _compile(self, out: Path) -> None:
        cxx = os.environ.get("CXX", "g++")
        if shutil.which(cxx) is None:
            raise BuildError(f"no C++ compiler {cxx!r} on PATH (set $CXX)")
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        cmd = [cxx, *self.flags(), f"-I{jax.ffi.include_dir()}", str(self.source), "-o", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            os.unlink(tmp)
            raise BuildError(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
        os.replace(tmp, out)

    def _load(self) -> ctypes.CDLL | str:
        if self._loaded is None:
            try:
                path = self.path()
                if not path.exists():
                    self._compile(path)
                self._loaded = ctypes.cdll.LoadLibrary(str(path))
            except (BuildError, OSError) as e:
                self._loaded = f"{type(e).__name__}: {e}"
        return self._loaded

    def load(self) -> ctypes.CDLL:
        """The loaded library, compiling it first if needed; BuildError if that fails."""
        lib = self._load()
        if isinstance(lib, str):
            raise BuildError(f"{self.source.name}: {lib}")
        return lib

    def error(self) -> str | None:
        """Why the library does not load here, or None when it does."""
        lib = self._load()
        return lib if isinstance(lib, str) else None


class FfiTarget:
    """An XLA FFI handler of a `Library`, registered for the CPU platform on first use."""

    def __init__(self, source: str | Path, target: str, symbol: str):
        self.library = Library(source)
        self.target, self.symbol = target, symbol
        self._error: str | None = None
        self._done = False

    def error(self) -> str | None:
        """None once the target is registered (compiling the library if needed), else why not."""
        if not self._done:
            try:
                handler = getattr(self.library.load(), self.symbol)
                jax.ffi.register_ffi_target(self.target, jax.ffi.pycapsule(handler), platform="cpu")
            except (BuildError, OSError) as e:
                self._error = str(e)
            self._done = True
        return self._error


def source_at_revision(rev: str, name: str) -> Path:
    """The kernel source `name` (a file beside this module) as of git revision `rev`, written to
    a temporary directory, so that an experiment can build it beside this tree's as its own
    FFI target (as the retired `cpu_matmul.py --baseline` and `cpu_attention_ab.py` did:
    JOURNAL.md 38b, 50c)."""
    here = Path(__file__).resolve().parent
    src = subprocess.run(
        ["git", "show", f"{rev}:{here.name}/{name}"], cwd=here.parent, check=True,
        capture_output=True, text=True,
    ).stdout  # fmt: skip
    path = Path(tempfile.mkdtemp()) / f"{Path(name).stem}_{rev}{Path(name).suffix}"
    path.write_text(src)
    return path
