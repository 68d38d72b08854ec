"""Incremental detokenization and stop-string matching. Host only.

Decoding one token at a time breaks multi-byte characters and word-initial spaces, so each step
decodes a short window twice (TGI / vLLM): the text of ids[prefix:read] and of ids[prefix:], and
emits the difference once it no longer ends in an incomplete character (U+FFFD). The window starts
with the prompt's last few tokens so the first output token gets its leading space right.
"""

from __future__ import annotations

_CONTEXT = 5  # prompt tokens kept as left context for the first output tokens


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Appends one output token; returns the new text it completes (maybe "")."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full[len(prefix) :]
        return ""


def find_stop(text: str, new_len: int, stops: list[str], include: bool) -> tuple[str, str] | None:
    """Looks for a stop string ending in the last `new_len` characters of `text`.

    Returns (truncated text, the stop string) for the match that completes first (the smallest
    end: what would stop generation if the new characters arrived one at a time; on a tie the
    one listed first, as vLLM's `check_stop_strings`), or None. The text keeps the stop string
    only when `include` (vLLM's include_stop_str_in_output).
    """
    best = None  # (end, list position, start, stop)
    for k, stop in enumerate(stops):
        begin = max(0, len(text) - new_len - len(stop) + 1)
        i = text.find(stop, begin)
        if i >= 0 and (best is None or i + len(stop) < best[0]):
            best = (i + len(stop), k, i, stop)
    if best is None:
        return None
    end, _, i, stop = best
    return (text[:end] if include else text[:i]), stop


def held_back(text: str, stops: list[str]) -> int:
    """Characters at the end of `text` that could be the start of a stop string (the longest
    suffix that is a proper prefix of one), held back from streamed snapshots as vLLM does: text
    shown while streaming is then never retracted when the stop string completes."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best
