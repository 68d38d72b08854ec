"""One prompt's text and token ids, by the same rules at every front door (`LLM.generate`,
`LLM.stream`, `AsyncLLM.generate` and so the OpenAI server, the batch job's rows):

    prompt_list(prompts) -> list              a str or dict is one prompt; bytes are refused
    parse_prompt(prompt, tokenizer) -> (text, token ids)   or PromptError naming the problem

A prompt is a str (tokenized here), {"prompt": str}, or {"prompt_token_ids": [...]} with an
optional "prompt" text beside the ids (vLLM's TextPrompt / TokensPrompt); any other key is an
error, as is a text without a tokenizer to read it. The ids are checked by the engine
(`RequestChecker.validate`: ints in the vocabulary, room to generate) where every request is.
"""

from __future__ import annotations

from collections.abc import Iterable

PROMPT_KEYS = ("prompt", "prompt_token_ids")


class PromptError(ValueError):
    """A prompt that cannot be read; `text` is its text where it has one (for the error output)."""

    def __init__(self, message: str, text: str | None = None):
        super().__init__(message)
        self.text = text


def prompt_list(prompts) -> list:
    """The prompts of one call as a list: a str or a dict is one prompt, any other iterable its
    items. ValueError for bytes (iterating would give one prompt per byte) and non-iterables."""
    if isinstance(prompts, bytes | bytearray | memoryview):
        raise ValueError(
            f"prompts is {type(prompts).__name__}: decode it to a str first (e.g. "
            "prompts.decode('utf-8')); a prompt is a str, a dict, or a list of them"
        )
    if isinstance(prompts, str | dict):
        return [prompts]
    if isinstance(prompts, Iterable):
        return list(prompts)
    raise ValueError(
        f"prompts must be a str, a dict or a list of them, got {type(prompts).__name__}"
    )


def parse_prompt(prompt, tokenizer) -> tuple[str | None, list[int]]:
    """(text, token ids) of one prompt (see the module docstring); PromptError otherwise."""
    if isinstance(prompt, dict):
        unknown = set(prompt) - set(PROMPT_KEYS)
        if unknown:
            raise PromptError(f"unknown prompt field(s) {sorted(unknown)}")
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list | tuple):
                raise PromptError("prompt_token_ids must be a list of ints")
            return prompt.get("prompt"), list(ids)
        if "prompt" not in prompt:
            raise PromptError("prompt dict needs 'prompt' or 'prompt_token_ids'")
        prompt = prompt["prompt"]
    if not isinstance(prompt, str):
        raise PromptError(f"a prompt must be a str or a dict, got {type(prompt).__name__}")
    if tokenizer is None:
        raise PromptError("text prompts need a tokenizer; pass prompt_token_ids", prompt)
    if prompt == "":
        raise PromptError("prompt is empty", prompt)
    try:
        return prompt, list(tokenizer(prompt)["input_ids"])
    except (TypeError, ValueError, UnicodeError) as e:  # e.g. a lone UTF-16 surrogate
        raise PromptError(f"cannot tokenize the prompt: {type(e).__name__}: {e}") from e
