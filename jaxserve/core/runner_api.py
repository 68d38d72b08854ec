"""The seam between the host loop and the device: what `LLMEngine` needs of a runner.

    handle = runner.dispatch(plan)    queue one plan's device work (asynchronously)
    result = runner.fetch(handle)     wait for it; ONE device->host transfer -> StepResult

`jaxserve.runner.runner.ModelRunner` is the real one; `jaxserve.testing.fake_runner.FakeRunner` is
a numpy stand-in whose tokens are computable by hand (JetStream's mock engine). Host only.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import numpy as np

from jaxserve.core.scheduler_output import SchedulerOutput


@dataclasses.dataclass
class StepResult:
    """Host copies of one step's outputs (S = slot rows of the decode step, k = decode_steps,
    K = top log-probs, R = prefill rows, T = chunk). A part the step did not run is None."""

    decode_tokens: np.ndarray | None = None  # i32[S, k]
    decode_valid: np.ndarray | None = None  # bool[S, k]
    decode_logprobs: np.ndarray | None = None  # f32[S, k]
    decode_top_ids: np.ndarray | None = None  # i32[S, k, K] (only when some slot asked)
    decode_top_logprobs: np.ndarray | None = None  # f32[S, k, K]
    decode_ranks: np.ndarray | None = None  # i32[S, k] the tokens' vLLM ranks (with the tops)
    prefill_tokens: np.ndarray | None = None  # i32[R]
    prefill_logprobs: np.ndarray | None = None  # f32[R]
    prefill_top_ids: np.ndarray | None = None  # i32[R, K]
    prefill_top_logprobs: np.ndarray | None = None  # f32[R, K]
    prefill_ranks: np.ndarray | None = None  # i32[R]
    prompt_logprobs: np.ndarray | None = None  # f32[R, T]
    prompt_top_ids: np.ndarray | None = None  # i32[R, T, K]
    prompt_top_logprobs: np.ndarray | None = None  # f32[R, T, K]
    prompt_ranks: np.ndarray | None = None  # i32[R, T]


class Runner(Protocol):
    """What the engine calls. `slot_buckets` are the decode row buckets the scheduler packs
    requests for (`jaxserve.resolve`); the counters feed `LLMEngine.stats()`."""

    slot_buckets: tuple[int, ...]
    num_h2d_transfers: int
    num_d2h_transfers: int
    # True: `dispatch` of a plan with grammar_deferred runs only the decode forward, and
    # `complete(handle, plan)` then takes the grammar masks the engine computed meanwhile
    overlaps_grammar: bool

    def dispatch(self, plan: SchedulerOutput) -> Any: ...

    def complete(self, handle: Any, plan: SchedulerOutput) -> Any: ...

    def fetch(self, handle: Any) -> StepResult: ...

    def warmup(self) -> float: ...
