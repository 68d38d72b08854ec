"""Tokenizers through transformers: from a HF model directory, or rebuilt from a GGUF's metadata.

    load_tokenizer(source, reader=None) -> PreTrainedTokenizerBase | None

A HF directory without tokenizer files (or a GGUF without tokenizer.* keys) gives None (the engine then serves token-id prompts only,
like vLLM's skip_tokenizer_init). A GGUF's `tokenizer.*` keys are read with gguf.GGUFReader,
renamed with transformers' GGUF_TOKENIZER_MAPPING, turned into a `tokenizers` backend by
`convert_gguf_tokenizer`, and wrapped in PreTrainedTokenizerFast with the chat template and
special tokens the file names: the same steps as `AutoTokenizer.from_pretrained(gguf_file=...)`
but without the torch import that path brings in.
"""

from __future__ import annotations

from pathlib import Path

import gguf
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast
from transformers.integrations.gguf.gguf_tokenizer_mapping import (
    GGUF_TOKENIZER_MAPPING,
    convert_gguf_tokenizer,
)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "vocab.json",
    "spiece.model",
)
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
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tok_config, **extra)


def load_tokenizer(
    source: str | Path, reader: gguf.GGUFReader | None = None
) -> PreTrainedTokenizerBase | None:
    """The tokenizer of a HF directory or a .gguf file; None when the source carries none."""
    source = Path(source)
    if source.is_dir():
        if not has_tokenizer_files(source):
            return None
        return AutoTokenizer.from_pretrained(str(source), local_files_only=True)
    if source.suffix == ".gguf":
        reader = reader if reader is not None else gguf.GGUFReader(source)
        if "tokenizer.ggml.tokens" not in reader.fields:
            return None
        return tokenizer_from_gguf(reader)
    raise ValueError(
        f"cannot load a tokenizer from {source}: expected a model directory or a .gguf file"
    )
