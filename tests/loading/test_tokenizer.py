"""Tokenizers: SmolLM2's rebuilt from its GGUF (no torch) must match Hugging Face's exactly."""

from __future__ import annotations

import json

import pytest
from model_testing import GOLDEN_DIR

from jaxserve.loading.tokenizer import load_tokenizer

pytestmark = pytest.mark.smollm2


@pytest.fixture(scope="module")
def golden():
    return json.loads((GOLDEN_DIR / "smollm2_greedy.json").read_text())["prompts"]


def test_gguf_tokenizer_matches_hf(smollm2_f32, golden):
    tok = smollm2_f32.tokenizer
    assert tok.bos_token_id == 1 and tok.eos_token_id == 2 and tok.eos_token == "<|im_end|>"
    for rec in golden:
        messages = [{"role": "user", "content": rec["prompt"]}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if not isinstance(ids, list) else ids
        assert ids == rec["prompt_token_ids"], rec["prompt"]
        assert tok(rec["prompt"])["input_ids"] == rec["plain_token_ids"], rec["prompt"]
        assert tok.decode(rec["token_ids"]) == rec["text"]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n") and "You are a helpful AI assistant" in text


def test_hf_directory_without_tokenizer_files_gives_none():
    assert load_tokenizer(GOLDEN_DIR / "llama") is None
