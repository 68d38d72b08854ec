"""Hugging Face Hub ids (`loading/hub.py`): resolved from a Hugging Face cache built here in a
temporary HF_HOME, in the layout huggingface_hub writes (`models--org--name/blobs/<sha256>`,
`snapshots/<commit>/<file>` symlinks to the blobs, `refs/<branch>` holding the commit), with the
hub off (HF_HUB_OFFLINE). The repositories hold the tiny golden checkpoints and SmolLM2's GGUF."""

from __future__ import annotations

import dataclasses
import hashlib
import http.server
import json
import os
import re
import shutil
import threading
import urllib.parse
from pathlib import Path

import jax
import numpy as np
import pytest
from huggingface_hub import constants
from model_testing import GOLDEN_DIR

from jaxserve.loading import hub, load_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"
COMMIT2 = "89abcdef0123456789abcdef0123456789abcdef"


def cache_repo(cache: Path, repo: str, files: dict, commit=COMMIT, ref="main") -> Path:
    """Writes `files` ({name: source path or bytes}) as repository `repo` at `commit`, with
    `refs/<ref>` naming it, the way huggingface_hub caches a download; -> the snapshot folder."""
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / ref).write_text(commit)
    snap = root / "snapshots" / commit
    for name, src in files.items():
        data = src if isinstance(src, bytes) else Path(src).read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / name).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, (snap / name).parent), snap / name)
    return snap


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache, the hub off (as HF_HUB_OFFLINE=1 sets it at import)."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def golden_files(name: str) -> dict:
    return {f: GOLDEN_DIR / name / f for f in ("config.json", "model.safetensors")}


def same_params(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(x, y) for x, y in zip(la, lb))


def test_repo_ids_and_local_paths_are_told_apart(tmp_path, monkeypatch):
    assert hub.is_repo_id("meta-llama/Llama-3.1-8B-Instruct")
    assert hub.is_repo_id("Qwen/Qwen3-0.6B-GGUF:Q8_0")
    assert hub.is_repo_id("unsloth/x-GGUF:x.Q4_K_M.gguf")
    for local in ("./a/b", "/abs/path", "~/models/x", "a/b/c", "model.gguf", "tiny", None):
        assert not hub.is_repo_id(local), local
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not hub.is_repo_id("org/name")  # an existing local folder wins, as in transformers


def test_a_cached_repository_loads_by_id_offline(hf_cache):
    cache_repo(hf_cache, "org/tiny-llama", golden_files("llama"))
    got = load_model("org/tiny-llama")
    want = load_model(GOLDEN_DIR / "llama")
    assert got.config == dataclasses.replace(want.config, name="org/tiny-llama")
    assert same_params(got.params, want.params)
    assert Path(got.source).parent.name == "snapshots"
    assert Path(got.source).is_relative_to(hf_cache)


def test_revision_picks_a_branch_or_a_commit(hf_cache):
    cache_repo(hf_cache, "org/m", golden_files("llama"))
    cache_repo(hf_cache, "org/m", golden_files("qwen3"), commit=COMMIT2, ref="v2")
    llama = dataclasses.replace(load_model(GOLDEN_DIR / "llama").config, name="org/m")
    assert load_model("org/m").config == llama
    qwen3 = dataclasses.replace(load_model(GOLDEN_DIR / "qwen3").config, name="org/m")
    assert load_model("org/m", revision="v2").config == qwen3
    assert load_model("org/m", revision=COMMIT2).config == qwen3
    with pytest.raises(
        ValueError, match=r"model 'org/m': org/m at revision 'v3' is not in the local"
    ):
        load_model("org/m", revision="v3")


def test_llm_takes_an_id_and_its_generation_config(hf_cache):
    from jaxserve import LLM

    gen = json.dumps({"temperature": 0.25, "top_p": 0.5, "eos_token_id": [2, 7]}).encode()
    cache_repo(hf_cache, "org/tiny-llama", {**golden_files("llama"), "generation_config.json": gen})
    llm = LLM("org/tiny-llama", dtype="float32", num_slots=2, max_model_len=32)
    assert llm.engine_config.model == "org/tiny-llama"  # the served name stays the id
    assert llm.default_sampling_params.temperature == 0.25
    assert llm.default_sampling_params.top_p == 0.5
    assert 7 in llm.model_config.eos_token_ids
    out = llm.generate({"prompt_token_ids": [1, 5, 9]}, dict(max_tokens=3, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.smollm2
def test_a_gguf_inside_a_repository_by_file_or_quant_type(hf_cache, smollm2_gguf_path):
    name = Path(smollm2_gguf_path).name  # SmolLM2-135M-Instruct.Q4_1.gguf
    other = b"not read: only the named file is"
    cache_repo(hf_cache, "org/SmolLM2-GGUF", {name: smollm2_gguf_path, "x.Q8_0.gguf": other})
    path = hub.resolve(f"org/SmolLM2-GGUF:{name}")
    assert Path(path).name == name and Path(path).read_bytes() == smollm2_gguf_path.read_bytes()
    assert hub.resolve("org/SmolLM2-GGUF:q4_1") == path  # vLLM's repo:quant_type form
    got = load_model("org/SmolLM2-GGUF:Q4_1")
    assert got.config.num_layers == 30 and got.tokenizer.encode("Hello") == [19556]
    with pytest.raises(ValueError, match=r"no \.gguf files of org/SmolLM2-GGUF match 'Q5_K'"):
        load_model("org/SmolLM2-GGUF:Q5_K")
    with pytest.raises(ValueError, match=r"2 \.gguf files of org/SmolLM2-GGUF match 'gguf'"):
        load_model("org/SmolLM2-GGUF:gguf")


def test_errors_name_the_id_and_the_cause(hf_cache):
    with pytest.raises(
        ValueError,
        match=r"model 'org/absent': org/absent is not in the local "
        r"Hugging Face cache .*HF_HUB_OFFLINE=1",
    ):
        load_model("org/absent")
    cache_repo(
        hf_cache,
        "org/bin-only",
        {
            "config.json": GOLDEN_DIR / "llama" / "config.json",
            "pytorch_model.bin": b"torch pickles are never read",
        },
    )
    with pytest.raises(
        ValueError,
        match=r"model 'org/bin-only': the repository has no "
        r"\*\.safetensors weights",
    ):
        load_model("org/bin-only")


def test_cached_files_are_checked_as_local_ones(hf_cache, tmp_path):
    """A snapshot file leading outside its cached repository is refused, as in a local folder."""
    snap = cache_repo(hf_cache, "org/evil", golden_files("llama"))
    outside = tmp_path / "secret.json"
    shutil.copy(GOLDEN_DIR / "llama" / "config.json", outside)
    (snap / "config.json").unlink()
    os.symlink(outside, snap / "config.json")
    with pytest.raises(ValueError, match="outside the model directory"):
        load_model("org/evil")


# -- online: a local stand-in for the hub -------------------------------------------------------------
class StandInHub(http.server.ThreadingHTTPServer):
    """The hub's few routes huggingface_hub uses to download a snapshot (repo info, file tree,
    resolve), over `repos` ({id: {file: bytes}}); "gated" ids answer 401 as a gated repository
    does. `fetched` records each file downloaded."""

    def __init__(self, repos: dict, gated=()):
        self.repos, self.gated, self.fetched = repos, set(gated), []
        super().__init__(("127.0.0.1", 0), _HubHandler)


class _HubHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _send(self, code, body=b"", headers=None, head=False):
        self.send_response(code)
        for k, v in {"Content-Length": str(len(body)), **(headers or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _route(self, head=False):
        hub_ = self.server
        path = urllib.parse.unquote(urllib.parse.urlparse(self.path).path)
        m = re.fullmatch(
            r"/api/models/([^/]+/[^/]+)/(revision|tree)/([^/]+)", path
        ) or re.fullmatch(r"/()([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if m is None:
            return self._send(404, b"{}", {"X-Error-Code": "EntryNotFound"}, head)
        if m.group(1):
            repo, kind, rev = m.groups()
        else:
            _, repo, rev, file = m.groups()
            kind = "resolve"
        if repo in hub_.gated:
            msg = {"X-Error-Code": "GatedRepo", "X-Error-Message": "Access to model is restricted"}
            return self._send(401, b"{}", msg, head)
        if repo not in hub_.repos:
            return self._send(404, b"{}", {"X-Error-Code": "RepoNotFound"}, head)
        files = hub_.repos[repo]
        if kind == "revision":
            info = {"id": repo, "sha": COMMIT, "siblings": [{"rfilename": f} for f in files]}
            return self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"})
        if kind == "tree":
            tree = [
                {"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                for f, b in files.items()
            ]
            return self._send(200, json.dumps(tree).encode(), {"Content-Type": "application/json"})
        if file not in files:
            return self._send(404, b"{}", {"X-Error-Code": "EntryNotFound"}, head)
        body = files[file]
        if not head:
            hub_.fetched.append(file)
        etag = f'"{hashlib.sha1(body).hexdigest()}"'
        self._send(200, body, {"X-Repo-Commit": COMMIT, "ETag": etag}, head)

    def do_GET(self):
        self._route()

    def do_HEAD(self):
        self._route(head=True)


@pytest.fixture
def stand_in_hub(tmp_path, monkeypatch):
    """A StandInHub on localhost as HF_ENDPOINT (the two constants it sets at import), the hub on
    and the cache empty."""
    llama = {f: Path(p).read_bytes() for f, p in golden_files("llama").items()}
    llama["pytorch_model.bin"] = b"a format jaxserve never reads: never downloaded"
    llama["README.md"] = b"# never downloaded"
    server = StandInHub({"org/tiny-llama": llama}, gated={"org/gated"})
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(
        constants,
        "HUGGINGFACE_CO_URL_TEMPLATE",
        endpoint + "/{repo_id}/resolve/{revision}/{filename}",
    )
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    yield server
    server.shutdown()


def test_online_only_the_engine_files_are_downloaded_then_cached(stand_in_hub):
    got = load_model("org/tiny-llama")
    assert sorted(stand_in_hub.fetched) == ["config.json", "model.safetensors"]
    assert same_params(got.params, load_model(GOLDEN_DIR / "llama").params)
    stand_in_hub.shutdown()  # the hub gone: the cached snapshot still loads, offline
    constants.HF_HUB_OFFLINE = True
    assert same_params(load_model("org/tiny-llama").params, got.params)


def test_online_errors_name_the_id_and_the_cause(stand_in_hub):
    with pytest.raises(ValueError, match=r"model 'org/gated': org/gated is gated: .*HF_TOKEN"):
        load_model("org/gated")
    with pytest.raises(ValueError, match=r"model 'org/nope': org/nope: no such repository"):
        load_model("org/nope")
