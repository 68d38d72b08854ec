"""The host loop: schedule -> run -> update, one engine step at a time.

    add_request(...)   checks one prompt (`request_checks.py`); a bad one becomes an error output
                       at the next step (the others are unaffected); n > 1 becomes n child
                       requests (distinct seeds)
    step()             plan = scheduler.schedule()      admit / chunk prefills / decode / preempt
                       handle = runner.dispatch(plan)   queue the device work (asynchronous)
                       [next plan scheduled and dispatched here: async scheduling]
                       result = runner.fetch(handle)    ONE transfer of the new tokens
                       _update(plan, result)            append tokens, detokenize, check stops,
                                                        retire (slot and pages freed at once)
                       -> outputs of finished requests (and snapshots of streamed ones)

Structured outputs (`structured_outputs.py`): the packed masks of a plan's constrained sampling
rows go to the runner beside the plan, made once the previous tokens are known (so no async
scheduling while a constrained request runs), while the step's decode forward runs where the
runner can (`overlaps_grammar`: `dispatch(plan, masks_later=True)`, then `complete(handle, masks)`).

Tokens become text, log-probs and stop decisions in `output_processor.py`. The runner is anything
implementing `runner_api.Runner` (`dispatch(plan)`, `fetch(handle) -> StepResult`, its decode row
buckets, transfer counters): `ModelRunner` on the device, or `jaxserve.testing.fake_runner`, a
numpy model whose tokens are computable by hand (tests/core/test_engine.py). Host only.
"""

from __future__ import annotations

import collections
import logging
import time

import numpy as np

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.core.data_parallel import make_scheduler
from jaxserve.core.detokenizer import IncrementalDetokenizer
from jaxserve.core.output_processor import (
    RequestGroup,
    add_prompt_logprobs,
    append_token,
    make_output,
)
from jaxserve.core.outputs import RequestOutput
from jaxserve.core.request import Request, RequestStatus, derive_seed, max_total_len
from jaxserve.core.request_checks import RequestChecker
from jaxserve.core.runner_api import Runner, StepResult
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.scheduler_output import SchedulerOutput
from jaxserve.core.structured_outputs import StructuredOutputManager
from jaxserve.lora.peft import read_adapter
from jaxserve.lora.request import LoRARequest
from jaxserve.lora.slots import LoRASlots

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        runner: Runner,
        model_config: ModelConfig,
        config: EngineConfig,
        num_pages: int,
        tokenizer=None,
    ):
        self.runner = runner
        self.model_config = model_config
        if not config.is_filled:
            raise ValueError(
                "LLMEngine needs an EngineConfig filled for the model: "
                "config.for_model(model_config) (engine_args.build_engine does it)"
            )
        self.config = config
        self.num_pages = num_pages
        self.loras = None
        lora = config.lora
        if lora.enable_lora:
            self.loras = LoRASlots(
                lora.max_loras,
                lora.max_cpu_loras or lora.max_loras,
                lambda req: read_adapter(req, model_config, lora.max_lora_rank),
            )
        self.scheduler = make_scheduler(config, num_pages, runner.slot_buckets, self.loras)
        # seeds of unseeded requests, drawn from the engine's seed (config.requests.seed)
        self._rng = np.random.default_rng(config.requests.seed)
        eos = set(model_config.eos_token_ids)
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(int(tokenizer.eos_token_id))
        self.eos_token_ids = eos = tuple(sorted(eos))
        self.structured = StructuredOutputManager(tokenizer, model_config.vocab_size, eos)
        self.checker = RequestChecker(
            model_config, config, num_pages, tokenizer, eos, self.structured, self.loras
        )
        self._groups: dict[str, RequestGroup] = {}
        self._pending: list[RequestOutput] = []  # error outputs, delivered by the next step()
        self._inflight = None  # (plan, device handle) dispatched but not yet fetched
        self._counter = 0
        # Counters (vLLM's names where they exist).
        self.num_steps = 0
        self.num_prefill_tokens = 0
        self.num_generation_tokens = 0
        self.num_finished = 0
        self.num_spec_drafts = 0  # speculative rows verified (vLLM: spec_decode_num_drafts)
        self.num_spec_draft_tokens = 0
        self.num_spec_accepted_tokens = 0
        self._occupancy_sum = 0.0
        self._kv_util_sum = 0.0
        self._kv_util_steps = 0
        self.timeline: collections.deque = collections.deque(maxlen=100_000)
        self._start = time.monotonic()

    # -- submission -------------------------------------------------------------------------------
    def next_request_id(self) -> str:
        self._counter += 1
        return str(self._counter - 1)

    @property
    def tokenizer(self):
        """The tokenizer (None for a model without one), the same object the checks read."""
        return self.checker.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer) -> None:
        self.checker.tokenizer = tokenizer

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        stream: bool = False,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queues one request; invalid input becomes an error output (`request_checks.py`).
        priority: lower runs first under scheduling_policy="priority"; ValueError under fcfs
        (vLLM's rule: a priority the policy would ignore is a caller's mistake).
        lora_request: the adapter to run with (LoRAConfig.enable_lora; ValueError without it);
        an adapter that cannot be read or does not fit the model is this request's error."""
        now = time.monotonic() if arrival_time is None else arrival_time
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already running")
        self.checker.check_priority(priority)
        n = sampling_params.n if isinstance(sampling_params, SamplingParams) else 1
        sampling_params, error = self.checker.check_request(prompt_token_ids, sampling_params)
        lora = None
        if error is None and lora_request is not None:
            lora, error = self.checker.read_lora(lora_request)
        grammar = None
        if error is None and sampling_params.structured_outputs is not None:
            try:  # a schema, regex or grammar that does not compile is this request's error
                grammar = self.structured.compile(sampling_params.structured_outputs)
            except ValueError as e:
                error = str(e)
        if error is not None:
            logger.info("request %s rejected: %s", request_id, error)
            self._pending.append(
                RequestOutput.from_error(request_id, prompt, prompt_token_ids, error, now, n)
            )
            return
        sp = sampling_params
        base_seed = sp.seed if sp.seed is not None else int(self._rng.integers(0, 2**32))
        prompt_token_ids = [int(t) for t in prompt_token_ids]
        max_total = max_total_len(len(prompt_token_ids), sp, self.config.scheduler.max_model_len)
        children = []
        for i in range(n):
            children.append(
                Request(
                    request_id=request_id if n == 1 else f"{request_id}-{i}",
                    group_id=request_id,
                    index=i,
                    prompt_token_ids=prompt_token_ids,
                    sampling_params=sp,
                    seed=derive_seed(base_seed, i),
                    eos_token_ids=self.eos_token_ids,
                    max_total_len=max_total,
                    arrival_time=now,
                    priority=priority,
                    lora=lora,
                    grammar=None if grammar is None else grammar if i == 0 else grammar.copy(),
                )
            )
        detoks = [
            IncrementalDetokenizer(self.tokenizer, prompt_token_ids, sp.skip_special_tokens)
            if self.tokenizer is not None and sp.detokenize  # detokenize=False: ids, no text
            else None
            for _ in children
        ]
        self._groups[request_id] = RequestGroup(
            request_id, prompt, prompt_token_ids, children, now, stream, detoks
        )
        for child in children[1:]:
            child.leader = children[0]  # with prefix caching, they share its prompt pages
        for child in children:
            self.scheduler.add(child)

    def abort(self, request_id: str) -> None:
        """Stops a request now; its tokens still in flight are dropped when they return."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return
        for child in group.children:
            if not child.status.finished:
                self.scheduler.finish(child, RequestStatus.FINISHED_ABORTED)

    def has_unfinished(self) -> bool:
        """Requests (or outputs) are outstanding. A step still in flight whose requests have all
        finished holds only wasted tokens; the next `step()` drains it."""
        return bool(self._groups or self._pending)

    def drain(self) -> None:
        """Waits for a step still in flight once no request is left (async scheduling queues one
        more step for requests that then finish): its tokens are discarded, so no device work or
        device->host copy outlives the caller's use of the engine (e.g. into interpreter exit)."""
        while self._inflight is not None and not self.has_unfinished():
            self.step()

    # -- the loop -------------------------------------------------------------------------------
    def _schedule_and_dispatch(self):
        plan = self.scheduler.schedule()
        if not plan.has_work and not plan.changes_slots:
            return None
        if plan.has_work:
            self._record_occupancy()
        rows = self.structured.sampling_rows(plan)  # slot -> grammar of each constrained row
        if not rows:
            return plan, self.runner.dispatch(plan)
        if plan.decode and self.runner.overlaps_grammar:
            # vLLM's overlap: the decode forward runs while the host computes the masks
            handle = self.runner.dispatch(plan, masks_later=True)
            masks = self.structured.masks(rows, self.config.scheduler.num_slots)
            return plan, self.runner.complete(handle, masks)
        masks = self.structured.masks(rows, self.config.scheduler.num_slots)
        return plan, self.runner.dispatch(plan, masks)

    def _constrained_running(self) -> bool:
        return any(r.grammar is not None for r in self.scheduler.running)

    def step(self) -> list[RequestOutput]:
        """One engine iteration; returns finished outputs (and snapshots of streamed requests).

        With async scheduling the next step is planned and queued on the device before this
        step's tokens are fetched, so the device does not wait for the host's bookkeeping.
        """
        outputs, self._pending = self._pending, []
        if self._inflight is None and self.scheduler.has_unfinished():
            self._inflight = self._schedule_and_dispatch()
            if self._inflight is None:
                raise RuntimeError("scheduler made no progress with requests pending")
        if self._inflight is None:
            return outputs
        plan, handle = self._inflight
        self._inflight = None
        # A grammar's next mask needs the token in flight: while a constrained request runs, the
        # next step is planned after this one's tokens are read (the scheduler would skip it).
        # After a speculative step the next one is planned ahead only if it speculates too: the
        # scheduler counted each row's k + 1 tokens, so its next plan gives the rows pages enough
        # and each a limit the device keeps to (a row it plans no tokens for does not move),
        # while a plain decode step would advance every active row, planned or not.
        if (
            self.config.scheduler.async_scheduling
            and self.scheduler.has_unfinished()
            and not self._constrained_running()
            and (not plan.speculative or self.scheduler.speculates())
        ):
            self._inflight = self._schedule_and_dispatch()
        result = self.runner.fetch(handle)
        touched = self._update(plan, result)
        self._record_kv_utilization()
        for group in touched:
            done = all(c.status.finished for c in group.children)
            if done or group.stream:
                outputs.append(make_output(group))
            if done:
                del self._groups[group.request_id]
                self.num_finished += 1
        return outputs

    def _update(self, plan: SchedulerOutput, result: StepResult) -> list[RequestGroup]:
        """Applies one step's tokens. K/V counts were advanced when the plan was made."""
        now = time.monotonic()
        touched: dict[str, RequestGroup] = {}
        for req, slot, steps in zip(plan.decode, plan.decode_slots, plan.decode_steps):
            req.num_pending_tokens -= steps
            if req.status.finished:
                continue  # stopped in the previous step (or aborted): these tokens are wasted
            made, out = steps, result.decode
            if plan.speculative:  # 1 to `steps` tokens: the accepted drafts and one more
                made = int(np.sum(out.valid[slot, :steps]))
                if made == 0:
                    raise RuntimeError(f"slot {slot} produced no token in a speculative step")
                self._count_speculation(req, steps, made, plan.num_decode_steps - 1)
            for j in range(made):
                if not out.valid[slot, j]:
                    raise RuntimeError(f"slot {slot} produced no token at decode step {j}")
                top = None if out.top is None else out.top.at(slot, j)
                lp = float(out.logprobs[slot, j])
                self._append(req, int(out.tokens[slot, j]), lp, top, now)
                if req.status.finished:
                    break
            touched[req.group_id] = self._groups[req.group_id]
        for i, (chunk, forced) in enumerate(zip(plan.prefill, plan.forced)):
            req = chunk.request
            self.num_prefill_tokens += chunk.length
            sampled = chunk.is_last and not forced
            req.num_pending_tokens -= int(sampled)
            if req.status.finished:
                continue
            if result.prompt is not None and req.sampling_params.prompt_logprobs is not None:
                add_prompt_logprobs(req, chunk, result.prompt, i, self.tokenizer)
            if sampled:
                out = result.prefill
                top = None if out.top is None else out.top.at(i)
                self._append(req, int(out.tokens[i]), float(out.logprobs[i]), top, now)
                touched[req.group_id] = self._groups[req.group_id]
        return list(touched.values())

    def _count_speculation(self, req: Request, planned: int, made: int, drafts: int) -> None:
        """A speculative row made `made` of the `planned` tokens the scheduler counted when it
        planned the step: its K/V count comes back down (a running request; a finished or
        preempted one has no count left to correct), and its `drafts` are counted (vLLM's
        spec_decode metrics: drafts, draft tokens, accepted tokens)."""
        if req.status == RequestStatus.RUNNING:
            req.num_computed_tokens -= planned - made
        self.num_spec_drafts += 1
        self.num_spec_draft_tokens += drafts
        self.num_spec_accepted_tokens += made - 1

    # -- outputs and stats ----------------------------------------------------------------------
    def _append(self, req: Request, token: int, logprob: float, top, now: float) -> None:
        """One generated token into `req`; retires it (slot and pages freed) if it stopped."""
        self.num_generation_tokens += 1
        detok = self._groups[req.group_id].detokenizers[req.index]
        accepted = req.grammar is None or req.grammar.accept(token)
        status = append_token(req, token, logprob, top, now, detok)
        if status is None and not accepted:
            # The mask allowed the token, yet the matcher failed: the grammar library hit one of
            # its limits mid-generation (a huge repetition count, say). That is the request's
            # error, reported as such (finish_reason "error" and .error), not a quiet abort.
            req.error = (
                "structured_outputs: the grammar failed during generation after "
                f"{len(req.output_token_ids)} tokens: {req.grammar.error or 'token rejected'}"
            )
            logger.warning("request %s: %s", req.request_id, req.error)
            status = RequestStatus.FINISHED_ERROR
        if status is not None:
            self.scheduler.finish(req, status)

    def _record_occupancy(self) -> None:
        self.num_steps += 1
        occ = len(self.scheduler.running) / self.config.scheduler.num_slots
        self._occupancy_sum += occ
        self._last_occupancy = occ

    def _record_kv_utilization(self) -> None:
        alloc = self.scheduler.allocator
        used = alloc.num_used_pages
        # a page shared by k requests (always a full one) holds its tokens once, not k times
        live = sum(r.num_computed_tokens for r in self.scheduler.running)
        page_size = self.config.cache.page_size
        live -= alloc.num_shared_refs * page_size
        util = live / (used * page_size) if used else None
        if util is not None:
            self._kv_util_sum += util
            self._kv_util_steps += 1
        self.timeline.append((time.monotonic() - self._start, self._last_occupancy, util))

    def stats(self) -> dict:
        steps = max(self.num_steps, 1)
        return {
            "num_steps": self.num_steps,
            "num_prefill_tokens": self.num_prefill_tokens,
            "num_generation_tokens": self.num_generation_tokens,
            "num_finished_requests": self.num_finished,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_spec_drafts": self.num_spec_drafts,
            "num_spec_draft_tokens": self.num_spec_draft_tokens,
            "num_spec_accepted_tokens": self.num_spec_accepted_tokens,
            "num_cached_prefill_tokens": self.scheduler.num_cached_tokens,
            "num_slot_moves": self.scheduler.num_slot_moves,
            "mean_decode_rows": (
                self.scheduler.decode_rows_sum / self.scheduler.num_decode_plans
                if self.scheduler.num_decode_plans
                else 0.0
            ),
            "mean_slot_occupancy": self._occupancy_sum / steps,
            "kv_page_utilization": (
                self._kv_util_sum / self._kv_util_steps if self._kv_util_steps else 0.0
            ),
            "num_kv_pages": self.num_pages,
            "num_h2d_transfers": self.runner.num_h2d_transfers,
            "num_d2h_transfers": self.runner.num_d2h_transfers,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
        }
