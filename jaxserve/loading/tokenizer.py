"""Tokenizers through transformers: from a HF model directory, or rebuilt from a GGUF's metadata.

    load_tokenizer(source, reader=None) -> PreTrainedTokenizerBase | None

A HF directory without tokenizer files (or a GGUF without tokenizer.* keys) gives None (the engine then serves token-id prompts only,
like vLLM's skip_tokenizer_init). A GGUF's `tokenizer.*` keys are read with gguf.GGUFReader,
renamed with transformers' GGUF_TOKENIZER_MAPPING, turned into a `tokenizers` backend by
`convert_gguf_tokenizer`, and wrapped in PreTrainedTokenizerFast with the chat template and
special tokens the file names: the same steps as `AutoTokenizer.from_pretrained(gguf_file=...)`
but without the torch import that path brings in.

Untrusted files: tokenizer files that transformers cannot load, a file that resolves outside the
model directory, and a chat template that is not UTF-8 or does not compile (in
chat_template.jinja, tokenizer_config.json or the GGUF's tokenizer.chat_template) raise
ModelLoadError naming the file at load time, not at the first chat request. (Rendering time is
bounded where templates are applied, not here.)
"""

from __future__ import annotations

from pathlib import Path

import gguf
import jinja2
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

try:  # where transformers 5.25 (this repo's CI) keeps the GGUF tokenizer table and converter
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )
except ImportError:  # where 5.17 (the lent H200's image) keeps them
    from transformers.integrations.ggml import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
from transformers.utils.chat_template_utils import _compile_jinja_template

from jaxserve.loading.gguf_file import open_gguf
from jaxserve.loading.hf import inside
from jaxserve.loading.loaded import ModelLoadError

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "vocab.json",
    "spiece.model",
)
# Where a directory's chat template can come from, in the order transformers prefers them.
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")
_SPECIAL_TOKENS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def has_tokenizer_files(model_dir: Path) -> bool:
    return any((Path(model_dir) / f).is_file() for f in TOKENIZER_FILES)


def tokenizer_from_gguf(reader: gguf.GGUFReader) -> PreTrainedTokenizerFast:
    """Builds the tokenizer a GGUF file describes (vocab, merges, special tokens, chat template)."""
    values = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    if "tokenizer.ggml.tokens" not in values:
        raise ValueError(
            "GGUF file has no tokenizer (metadata key tokenizer.ggml.tokens is missing)"
        )
    grouped = {
        group: {
            name: values[f"tokenizer.{key}"]
            for key, name in renames.items()
            if f"tokenizer.{key}" in values
        }
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tok_dict, tok_config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tok_dict.get("tokenizer_type") == "llama":
        # llama.cpp adds BOS to a sentencepiece vocabulary whose file does not say otherwise.
        tok_config.setdefault("add_bos_token", True)
    tokens = tok_dict["tokens"]
    for name, key in _SPECIAL_TOKENS.items():
        token_id = values.get(f"tokenizer.ggml.{key}")
        tok_config[name] = tokens[int(token_id)] if token_id is not None else None
    architecture = reader.fields["general.architecture"].contents()
    backend, extra = convert_gguf_tokenizer(architecture, tok_dict)
    # transformers <= 5.17's converter also returns special tokens; the file's own ids win.
    return PreTrainedTokenizerFast(tokenizer_object=backend, **(extra | tok_config))


def check_chat_template(tokenizer: PreTrainedTokenizerBase, where) -> None:
    """Compiles the tokenizer's chat template(s) as transformers will; ModelLoadError naming
    `where` (the file the template came from) when one does not compile."""
    templates = tokenizer.chat_template
    if templates is None:
        return
    if isinstance(templates, str):
        templates = {"default": templates}
    for name, template in dict(templates).items():
        if not isinstance(template, str):
            raise ModelLoadError(where, f"chat template {name!r} is not a string: {template!r}")
        try:
            _compile_jinja_template(template)
        except jinja2.TemplateError as e:
            raise ModelLoadError(where, f"malformed chat template {name!r}: {e}") from e


def _template_source(model_dir: Path) -> Path:
    return next(
        (model_dir / f for f in TEMPLATE_FILES if (model_dir / f).is_file()),
        model_dir / "tokenizer_config.json",
    )


def _tokenizer_from_dir(source: Path) -> PreTrainedTokenizerBase:
    for entry in source.iterdir():
        inside(source, entry)  # transformers opens files by name: none may lead elsewhere
    for f in TEMPLATE_FILES:
        if (source / f).is_file():
            try:
                (source / f).read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise ModelLoadError(source / f, f"not UTF-8 text: {e}") from e
    try:
        tok = AutoTokenizer.from_pretrained(str(source), local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:  # incl. bad JSON
        raise ModelLoadError(
            source, f"cannot load the tokenizer files: {type(e).__name__}: {e}"
        ) from e
    check_chat_template(tok, _template_source(source))
    return tok


def _tokenizer_from_gguf_file(source: Path, reader: gguf.GGUFReader) -> PreTrainedTokenizerFast:
    try:
        tok = tokenizer_from_gguf(reader)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
        raise ModelLoadError(
            source, f"cannot build the tokenizer from its metadata: {type(e).__name__}: {e}"
        ) from e
    check_chat_template(tok, f"{source} (tokenizer.chat_template)")
    return tok


def load_tokenizer(
    source: str | Path, reader: gguf.GGUFReader | None = None
) -> PreTrainedTokenizerBase | None:
    """The tokenizer of a HF directory or a .gguf file; None when the source carries none."""
    source = Path(source)
    if source.is_dir():
        if not has_tokenizer_files(source):
            return None
        return _tokenizer_from_dir(source)
    if source.suffix == ".gguf":
        reader = reader if reader is not None else open_gguf(source)
        if "tokenizer.ggml.tokens" not in reader.fields:
            return None
        return _tokenizer_from_gguf_file(source, reader)
    raise ValueError(
        f"cannot load a tokenizer from {source}: expected a model directory or a .gguf file"
    )
