"""The seam between the host loop and the device: what `LLMEngine` needs of a runner.

    handle = runner.dispatch(plan, masks)    queue one plan's device work (asynchronously), with
                                             the grammar masks of its constrained rows (or None)
    result = runner.fetch(handle)            wait for it; ONE device->host transfer -> StepResult

A runner that `overlaps_grammar` also takes the masks late, so the host computes them while the
step's decode forward runs: handle = runner.complete(runner.dispatch(plan, masks_later=True), masks).

`jaxserve.runner.runner.ModelRunner` is the real one; `jaxserve.testing.fake_runner.FakeRunner` is
a numpy stand-in whose tokens are computable by hand (JetStream's mock engine). Host only.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import numpy as np

from jaxserve.core.scheduler_output import SchedulerOutput
from jaxserve.core.structured_outputs import GrammarMasks


@dataclasses.dataclass(frozen=True)
class TopLogprobs:
    """The best K tokens of each position a step sampled or scored, best first, and the rank of
    the token it took (vLLM's: 1 = the best), when some request asked for log-probs."""

    ids: np.ndarray  # i32[..., K]
    logprobs: np.ndarray  # f32[..., K]
    ranks: np.ndarray | None = None  # i32[...]

    def at(self, *index) -> tuple:
        """(ids, logprobs, rank or None) of one position: what `logprob_entry` takes."""
        return (
            self.ids[index],
            self.logprobs[index],
            None if self.ranks is None else self.ranks[index],
        )


@dataclasses.dataclass(frozen=True)
class Sampled:
    """The tokens a step sampled: a decode step's [S, k] (slot rows x decode steps; `valid` says
    which were made) or a prefill step's [R] (one per chunk row), with their log-probs."""

    tokens: np.ndarray  # i32[S, k] | i32[R]
    logprobs: np.ndarray  # f32, the same shape
    top: TopLogprobs | None = None
    valid: np.ndarray | None = None  # bool[S, k] (decode only)


@dataclasses.dataclass(frozen=True)
class PromptScores:
    """The log-probs of the prompt tokens each chunk row scored: f32[R, T] (and their tops)."""

    logprobs: np.ndarray  # f32[R, T]
    top: TopLogprobs | None = None


@dataclasses.dataclass(frozen=True)
class StepResult:
    """Host copies of one step's outputs: what it decoded, what its prefill chunks sampled, the
    prompt tokens they scored (S = slot rows of the decode step, k = decode_steps, K = top
    log-probs, R = prefill rows, T = chunk). A part the step did not run is None."""

    decode: Sampled | None = None
    prefill: Sampled | None = None
    prompt: PromptScores | None = None

    @classmethod
    def from_arrays(cls, host: dict[str, np.ndarray]) -> StepResult:
        """From the runner's flat transfer (`step_handle.fetch_outputs`): decode_tokens,
        decode_valid, decode_logprobs, decode_top_ids, decode_top_logprobs, decode_ranks; the
        same prefill_* but valid; prompt_logprobs, prompt_top_ids, prompt_top_logprobs,
        prompt_ranks (each present only when the step computed it)."""

        def top(part: str) -> TopLogprobs | None:
            if f"{part}_top_ids" not in host:
                return None
            ranks = host.get(f"{part}_ranks")
            return TopLogprobs(host[f"{part}_top_ids"], host[f"{part}_top_logprobs"], ranks)

        def sampled(part: str) -> Sampled | None:
            if f"{part}_tokens" not in host:
                return None
            valid = host.get(f"{part}_valid")
            return Sampled(host[f"{part}_tokens"], host[f"{part}_logprobs"], top(part), valid)

        prompt = None
        if "prompt_logprobs" in host:
            prompt = PromptScores(host["prompt_logprobs"], top("prompt"))
        return cls(sampled("decode"), sampled("prefill"), prompt)


class Runner(Protocol):
    """What the engine calls. `slot_buckets` are the decode row buckets the scheduler packs
    requests for (`jaxserve.resolve`); the counters feed `LLMEngine.stats()`."""

    slot_buckets: tuple[int, ...]
    num_h2d_transfers: int
    num_d2h_transfers: int
    # True: `dispatch(plan, masks_later=True)` of a plan that decodes queues only the decode
    # forward, and `complete(handle, masks)` then takes the masks the engine computed meanwhile
    overlaps_grammar: bool

    def dispatch(
        self, plan: SchedulerOutput, masks: GrammarMasks | None = None, masks_later: bool = False
    ) -> Any: ...

    def complete(self, handle: Any, masks: GrammarMasks) -> Any: ...

    def fetch(self, handle: Any) -> StepResult: ...

    def warmup(self) -> float: ...
