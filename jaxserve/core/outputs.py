"""What `LLM.generate` returns: vLLM's `RequestOutput` / `CompletionOutput` / `Logprob`. Host only.

Log-probs are dicts `{token_id: Logprob(logprob, rank, decoded_token)}` per position (vLLM's
`SampleLogprobs` / `PromptLogprobs`): for a generated token, the chosen token plus the top-n
(`SamplingParams.logprobs`); for a prompt token, the prompt token plus the top-n
(`prompt_logprobs`, first entry None). A top-n entry's rank is its place (1 = most likely); the
chosen token's rank is the number of tokens at least as likely, itself included (vLLM's count:
ties rank after), counted by the device over the whole vocabulary, so it is exact however
unlikely the token. decoded_token is the token's text alone
(None without a tokenizer). Log-probs are of the raw model distribution. `cumulative_logprob` is
None unless log-probs were requested, as in vLLM.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class RequestMetrics:
    arrival_time: float  # time.monotonic() at submission
    first_token_time: float | None = None  # first generated token reached the host
    finished_time: float | None = None
    ttft: float | None = None  # seconds from arrival to first token
    tpot: float | None = None  # seconds per output token after the first
    num_preemptions: int = 0


@dataclasses.dataclass
class Logprob:
    """One token's log-prob at one position (vLLM's `vllm.logprobs.Logprob`)."""

    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    index: int  # child index in [0, n)
    text: str  # "" when the model has no tokenizer
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "error" | "abort" | None (still running)
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict[int, Logprob]] | None = None  # per generated token, when requested
    cumulative_logprob: float | None = None  # None unless logprobs were requested (vLLM)

    def finished(self) -> bool:
        """Whether this sample has finished (a method, as in vLLM)."""
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None  # set (and every finish_reason "error") when the request was rejected
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # prefill tokens taken from the prefix cache (summed over the n children; their last admission)
    num_cached_tokens: int = 0

    @classmethod
    def from_error(
        cls,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        error: str,
        arrival_time: float,
        n: int = 1,
    ) -> RequestOutput:
        outs = [CompletionOutput(i, "", [], "error") for i in range(max(n, 1))]
        metrics = RequestMetrics(arrival_time=arrival_time, finished_time=arrival_time)
        return cls(request_id, prompt, list(prompt_token_ids), outs, True, metrics, error=error)
