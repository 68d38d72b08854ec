"""Hugging Face Hub ids: `LLM("org/name")`, `--model org/name`, resolved the way vLLM and
transformers resolve them, by `huggingface_hub` (no HTTP of our own).

    is_repo_id(model)                         whether `model` names a repository, not a local path
    resolve(model, revision=None, token=None) -> the local path the loaders read

Resolution: the local cache first (`HF_HOME` / `HF_HUB_CACHE`, the `models--org--name/snapshots/
<commit>` layout huggingface_hub keeps); when online (not `HF_HUB_OFFLINE=1`) a download of only
what the engine reads (`ENGINE_FILES`: config, generation config, tokenizer files, safetensors
and their index; never *.bin, *.pt or other formats' files). `revision` is a branch, tag or
commit; `token` (else `HF_TOKEN`, else the saved login) opens gated and private repositories.

A GGUF inside a repository is vLLM's `org/name:file.gguf` (that one file), or `org/name:QUANT`
(the one .gguf whose name carries QUANT, e.g. `:Q4_K_M`); the file alone is downloaded.

The loaders then treat the snapshot as any local folder: every size check applies, and no file
may resolve outside the cached repository (`hf.allowed_root`). Errors are ValueErrors naming the
id and the cause: not found, gated without a token, a revision that does not exist, offline and
not cached, no safetensors.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import re

log = logging.getLogger(__name__)

# What the engine reads from a repository: the loaders (hf.py), the tokenizer (tokenizer.py:
# transformers' tokenizer files and chat templates) and generation_config.json (engine_args.py).
ENGINE_FILES = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
TOKENIZER_FILES = tuple(f for f in ENGINE_FILES if "safetensors" not in f)

# org/name[:file-or-quant]: Hugging Face's repository naming (letters, digits, '-', '_', '.';
# at most 96 characters per part), as huggingface_hub's validate_repo_id checks it.
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.\-]{0,95}/[A-Za-z0-9][\w.\-]{0,95}(?::[^/\\]+)?")


class NoMatchingFile(LookupError):
    """org/name:QUANT matched no .gguf of the repository, or several."""


def is_repo_id(model) -> bool:
    """Whether `model` is a repository id: a str of the form org/name[:file], not an existing
    local path (a local folder `org/name` wins, as in transformers)."""
    if not isinstance(model, str) or os.path.exists(model):
        return False
    return _REPO_ID.fullmatch(model) is not None and not model.startswith((".", "~"))


def _split(model: str) -> tuple[str, str | None]:
    repo, _, file = model.partition(":")
    return repo, file or None


def resolve(model: str, revision: str | None = None, token=None, tokenizer_only=False) -> str:
    """The local folder (or .gguf file) of repository id `model`; see the module docstring.
    tokenizer_only: only the tokenizer files (for a `tokenizer=` repository)."""
    from huggingface_hub import constants

    repo, file = _split(model)
    offline = constants.HF_HUB_OFFLINE
    where = f"{repo}" + (f" at revision {revision!r}" if revision else "")
    try:
        if file is not None:
            path = _gguf(repo, file, revision, token)
        else:
            path = _snapshot(repo, revision, token, TOKENIZER_FILES if tokenizer_only else None)
    except Exception as e:  # huggingface_hub's errors -> one ValueError naming the id
        raise ValueError(f"model {model!r}: {_cause(e, where, offline)}") from e
    if file is None and not tokenizer_only and not _has_weights(path):
        raise ValueError(
            f"model {model!r}: the repository has no *.safetensors weights (jaxserve reads "
            "safetensors, GGUF via 'org/name:file.gguf', or a converted checkpoint); a "
            "PyTorch-only (*.bin) repository must be converted to safetensors first"
        )
    log.info("model %s -> %s", model, path)
    return path


def _snapshot(repo: str, revision, token, patterns) -> str:
    from huggingface_hub import snapshot_download

    patterns = list(patterns or ENGINE_FILES)
    return snapshot_download(repo, revision=revision, token=token, allow_patterns=patterns)


def _gguf(repo: str, file: str, revision, token) -> str:
    """The one .gguf of `repo` named `file`, or (a quant type such as Q4_K_M) carrying it."""
    from huggingface_hub import HfApi, hf_hub_download

    if not file.endswith(".gguf"):
        files = [f for f in _repo_files(HfApi(), repo, revision, token) if f.endswith(".gguf")]
        hits = [f for f in files if file.lower() in os.path.basename(f).lower()]
        if len(hits) != 1:
            raise NoMatchingFile(
                f"{'no' if not hits else len(hits)} .gguf files of {repo} match {file!r}"
                f"{': ' + ', '.join(hits) if hits else ''} (its .gguf files: {files}); name the "
                "file: org/name:file.gguf"
            )
        file = hits[0]
    return hf_hub_download(repo, file, revision=revision, token=token)


def _repo_files(api, repo: str, revision, token) -> list[str]:
    """The repository's file names: from the cache when offline, else from the hub."""
    from huggingface_hub import constants, scan_cache_dir

    if not constants.HF_HUB_OFFLINE:
        return api.list_repo_files(repo, revision=revision, token=token)
    for cached in scan_cache_dir().repos:
        if cached.repo_id == repo and cached.repo_type == "model":
            return sorted({f.file_name for r in cached.revisions for f in r.files})
    return []


def _has_weights(path: str) -> bool:
    return any(fnmatch.fnmatch(f, "*.safetensors") for f in os.listdir(path))


def _cause(e: Exception, where: str, offline: bool) -> str:
    from huggingface_hub import errors

    if isinstance(e, NoMatchingFile):
        return str(e)
    if isinstance(e, errors.GatedRepoError):
        return (
            f"{where} is gated: accept its terms on the hub, then pass a token (HF_TOKEN, "
            "`hf auth login`, or LLM(..., hf_token=...))"
        )
    if isinstance(e, errors.RevisionNotFoundError):
        return f"{where}: no such revision (a branch, tag or commit of the repository)"
    if isinstance(e, errors.RepositoryNotFoundError):
        return (
            f"{where}: no such repository on the hub (or it is private: pass a token), and "
            "no such local path"
        )
    if isinstance(e, errors.LocalEntryNotFoundError) or (offline and isinstance(e, OSError)):
        return (
            f"{where} is not in the local Hugging Face cache ({_cache_dir()}) and the hub is "
            f"{'off (HF_HUB_OFFLINE=1)' if offline else 'unreachable'}: download it once online "
            "(e.g. `hf download`), or pass a local folder"
        )
    if isinstance(e, errors.EntryNotFoundError):
        return f"{where}: no such file in the repository: {e}"
    return f"{where}: {type(e).__name__}: {e}"


def _cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)
