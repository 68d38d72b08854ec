"""A fake LLM for batch-job tests whose outputs are computable by hand (no jax, no model).

Tokens are the prompt's UTF-8 bytes. The completion of a prompt whose last token is `t` is
`t+1, t+2, ...` (mod 256) for `max_tokens` tokens, finish_reason "length", text = those bytes as
latin-1 characters. A prompt longer than `max_model_len` tokens is rejected with an error output,
like the engine does. Requests finish in an order that is not the input order: shortest
`max_tokens` first, ties by descending index.
"""

from __future__ import annotations

import time

from jaxserve.core.outputs import CompletionOutput, RequestMetrics, RequestOutput


def expected_tokens(prompt_ids: list[int], max_tokens: int) -> list[int]:
    return [(prompt_ids[-1] + k + 1) % 256 for k in range(max_tokens)]


def expected_text(prompt_ids: list[int], max_tokens: int) -> str:
    return "".join(chr(t) for t in expected_tokens(prompt_ids, max_tokens))


class FakeTokenizer:
    """Chat template: '<role>content' per message, then '<assistant>'; tokens are UTF-8 bytes."""

    chat_template = "fake"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert not tokenize and add_generation_prompt
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": list(text.encode("utf-8"))}  # no special tokens to add


class FakeLLM:
    source = "fake"

    def __init__(self, max_model_len: int = 64, on_output=None, per_step: int = 1, tokenizer=None):
        self.max_model_len = max_model_len
        # With a tokenizer, str prompts are tokenized at submission, like `LLM._submit` (an
        # exception there escapes iter_generate, as in the real LLM).
        self.tokenizer = tokenizer
        self.per_step = per_step  # outputs finishing in one engine "step"
        self.on_output = on_output  # called with the number of outputs yielded so far
        self.submitted: list = []  # every prompt passed to iter_generate
        self.closed = False
        self.yielded = 0

    def get_tokenizer(self):
        return FakeTokenizer()

    def stats(self):
        return {"steps": self.yielded, "preemptions": 0, "kv_page_utilization": 0.25}

    def iter_generate(self, prompts, sampling_params, stop=None):
        """As `LLM.iter_generate`: outputs finish `per_step` per step; `stop` is checked before
        every step, and the outputs of the step already run are all yielded first."""
        self.submitted.extend(prompts)
        if self.tokenizer is not None:
            prompts = [
                {"prompt_token_ids": self.tokenizer(p)["input_ids"]} if isinstance(p, str) else p
                for p in prompts
            ]
        order = sorted(range(len(prompts)), key=lambda i: (sampling_params[i].max_tokens, -i))
        steps = [order[s : s + self.per_step] for s in range(0, len(order), self.per_step)]
        try:
            for step in steps:
                if stop is not None and stop():
                    break
                for i in step:
                    yield i, self._run(i, prompts[i], sampling_params[i])
                    self.yielded += 1
                    if self.on_output is not None:
                        self.on_output(self.yielded)
        finally:  # ended (stop) or closed early by the job
            self.closed = True

    def _run(self, i, prompt, sp):
        ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else list(prompt.encode())
        now = time.monotonic()
        if len(ids) > self.max_model_len:
            error = f"prompt has {len(ids)} tokens, more than max_model_len={self.max_model_len}"
            return RequestOutput.from_error(str(i), None, ids, error, now)
        toks = expected_tokens(ids, sp.max_tokens)
        comp = CompletionOutput(0, expected_text(ids, sp.max_tokens), toks, "length")
        metrics = RequestMetrics(
            now, now, now, ttft=0.01 * (i + 1), tpot=0.001, num_preemptions=i % 2
        )
        return RequestOutput(str(i), None, ids, [comp], True, metrics)
