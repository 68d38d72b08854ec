"""One sequence being served: its tokens, how far its K/V are computed, its slot and pages.

Host only (never imports jax). A prompt with `n` > 1 becomes n `Request`s (children) that share the
prompt and differ in seed; the engine groups them back into one `RequestOutput`.

Token bookkeeping (vLLM's words):

    all_token_ids        prompt_token_ids + output_token_ids
    num_computed_tokens  tokens whose K/V are in the cache once the dispatched steps finish (the
                         scheduler advances it when it plans a step, not when the step returns)
    num_pending_tokens   output tokens of dispatched steps not yet received by the host
    num_prefill_tokens   tokens the current (re)prefill must compute: the prompt, or after a
                         preemption the prompt plus every generated token but the last
    last output token    not yet in the cache: the next decode step feeds it

After a preemption (recompute), `begin_prefill` sets the prefill target to prompt + outputs[:-1];
the final chunk then puts outputs[-1] in the slot as its last token instead of sampling
(`forced_token`), so the resumed sequence continues exactly where it stopped.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from jaxserve.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


@dataclasses.dataclass(eq=False)
class Request:
    request_id: str  # unique per child: "<group id>" or "<group id>-<index>"
    group_id: str  # the user-facing request id shared by the n children
    index: int  # child index in [0, n)
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int  # concrete per-child seed (derived when the params carry none)
    eos_token_ids: tuple[int, ...]
    max_total_len: int  # prompt + output never exceed this: min(prompt + max_tokens, max_model_len)
    arrival_time: float
    priority: int = 0  # scheduling_policy="priority": lower runs first (vLLM)
    order: int = 0  # arrival order, set by the scheduler (ties of priority go to the older)
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] = dataclasses.field(default_factory=list)
    cumulative_logprob: float = 0.0
    text: str = ""
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    error: str | None = None  # why it ended in FINISHED_ERROR (its output's .error)
    num_computed_tokens: int = 0
    num_prefill_tokens: int = 0
    num_pending_tokens: int = 0  # output tokens scheduled on the device, not yet seen by the host
    slot: int | None = None
    pages: list[int] = dataclasses.field(default_factory=list)
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    # Prefix caching: uids of the keys of this sequence's first full pages (matched or registered,
    # see prefix_cache), prefill tokens taken from the cache at the last admission, and child 0
    # of an n > 1 request (its siblings wait for its prompt pages instead of recomputing them).
    block_uids: list[int] = dataclasses.field(default_factory=list)
    num_cached_tokens: int = 0
    leader: Request | None = dataclasses.field(default=None, repr=False)
    # structured outputs: the request's `structured_outputs.Grammar` (None = unconstrained)
    grammar: Any = dataclasses.field(default=None, repr=False)
    # LoRA (EngineConfig.enable_lora): the request's adapter (`lora.peft.LoRAAdapter`, None = the
    # base model) and, while it is admitted, the device slot holding it (-1: none)
    lora: Any = dataclasses.field(default=None, repr=False)
    lora_slot: int = -1

    @property
    def lora_int_id(self) -> int:
        """The adapter's id, 0 for the base model (what prefix-cache keys are kept under)."""
        return 0 if self.lora is None else self.lora.lora_int_id

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_scheduled_tokens_total(self) -> int:
        """Tokens the sequence will hold once every step already dispatched has returned."""
        return self.num_tokens + self.num_pending_tokens

    @property
    def prefill_done(self) -> bool:
        return self.num_computed_tokens >= self.num_prefill_tokens

    @property
    def forced_token(self) -> int | None:
        """The token the final prefill chunk installs instead of sampling (resume after preemption)."""
        return self.output_token_ids[-1] if self.output_token_ids else None

    @property
    def finish_reason(self) -> str | None:
        if not self.status.finished or self.status == RequestStatus.FINISHED_ABORTED:
            return "abort" if self.status == RequestStatus.FINISHED_ABORTED else None
        return self.status.value

    def begin_prefill(self) -> None:
        """(Re)starts the prefill: everything but the last generated token is recomputed (the
        scheduler may then take its first full pages from the prefix cache)."""
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.block_uids = []
        self.num_prefill_tokens = len(self.prompt_token_ids) + max(
            len(self.output_token_ids) - 1, 0
        )
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]  # the first prompt token has no log-prob (as in vLLM)


def derive_seed(seed: int, index: int) -> int:
    """Seed of child `index` of a request seeded `seed`: seed + index, as vLLM's parallel sampling
    (`vllm/v1/engine/parallel_sampling.py`); past 2**64 it wraps (the same 64-bit key)."""
    child = seed + index
    return child - (1 << 64) if child >= 1 << 64 else child


def max_total_len(prompt_len: int, sp: SamplingParams, max_model_len: int) -> int:
    """Prompt + output never exceed this; max_tokens None runs to max_model_len (vLLM)."""
    if sp.max_tokens is None:
        return max_model_len
    return min(prompt_len + sp.max_tokens, max_model_len)
