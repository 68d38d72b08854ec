"""The scheduler: a waiting queue, a slot table and the KV pages. Host only (no jax).

`schedule()` returns a `SchedulerOutput` (the plan of one engine step: `scheduler_output.py`);
the engine runs it and calls `finish()` for the requests that stopped. A plan is made in five
phases:

  1. _compact: with decode row buckets (SchedulerConfig.slot_buckets) the decode step computes
     only the first B slots. Admission takes the lowest free slot; when retirements leave few
     enough requests for a smaller bucket, those in slots >= B move to free slots below it
     (`plan.moves`, applied by the runner before anything else of the plan but the releases).
  2. _schedule_decodes: every running request whose prefill is done generates `decode_steps`
     tokens (fewer near its length limit). Pages are allocated for them first. When the pool is
     empty the newest running request is preempted by recompute: its pages and slot are freed at
     once and it goes back to the front of the waiting queue, keeping its generated tokens.
  3. _schedule_prefills: running requests with prompt left get the next fixed-size chunk
     (`prefill_chunk_size` tokens), oldest first, at most `max_prefill_rows` chunks per step
     (= max_num_batched_tokens // prefill_chunk_size), so a long prompt is spread over many steps
     and never stalls the running decodes.
  With scheduling_policy="priority" (vLLM's) the waiting queue is kept in (priority, arrival)
  order and the preempted request is the running one of lowest priority (largest value), newest
  among equals; fcfs is that with every priority 0.
  4. _admit: waiting requests, oldest first, take the lowest free slots as the admission policy
     (chosen once from SchedulerConfig.batching) allows, and their first chunk while rows are
     left:
       ContinuousAdmission  while chunk rows and pages (with a small watermark) allow; with prefix
                            caching the children of an n > 1 request wait at the head of the queue
                            while child 0 prefills a prompt of a page or more, then share its pages
       StaticAdmission      a new batch only when no request is running, then as many requests as
                            there are slots, whatever the rows and pages (the baseline)
     An admitted request first takes the cached pages its tokens begin with (`PrefixCache.take`)
     and prefills only the rest. With LoRA, a request also takes a device slot for its adapter
     (`lora/slots.py`); one whose adapter finds none (every slot held by other adapters'
     requests) is skipped and keeps its place, and the requests behind it go on (vLLM's rule).
  5. _commit: advances the planned requests as if the plan had run, and registers every full page
     a prefill chunk completes (prefix_cache.py).

Prefix caching registers only pages a prefill computed, never pages of K/V that decode steps wrote
(unlike vLLM): those differ in bf16 from what a prefill computes for the same tokens, and a hit
must not change an output (issue 24). So a chat's next turn finds the previous turn's prompt pages
and recomputes its answer; a request resumed after preemption finds its prompt pages (and, after
a second preemption, those its resumed prefill computed). A plan only reads pages registered by
earlier plans, which the device runs first. Requests that want prompt log-probs compute their
whole prompt.

Plans may run one step ahead of the host (SchedulerConfig.async_scheduling): `_commit` advances
`num_computed_tokens` and `num_pending_tokens` when a plan is made, so the next plan is exact except
that a request which stopped (EOS, stop string) in the step still in flight decodes one wasted
token before it is retired. The device decodes every active slot; a slot left out of `plan.decode`
is one at its length limit, which the device's own guard skips. Everything a released slot held is
gone before the slot is reused (the runner applies `released` first, and the device runs steps in
dispatch order, so a retired request's last writes land before a new owner writes its pages).
"""

from __future__ import annotations

import collections

from jaxserve.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from jaxserve.core.admission import AdmissionPolicy, ContinuousAdmission, StaticAdmission
from jaxserve.core.page_allocator import PageAllocator, pages_for
from jaxserve.core.prefix_cache import PrefixCache
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler_output import PrefillChunk, SchedulerOutput
from jaxserve.lora.slots import LoRASlots
from jaxserve.resolve import bucket_for


def can_speculate(req: Request) -> bool:
    """The request's next tokens are the target's argmax alone (greedy; no penalties, logits
    processors, min_tokens, grammar or log-probs), which a speculative step verifies. min_tokens
    counts the tokens already received (those in flight may be fewer than planned)."""
    sp = req.sampling_params
    return (
        sp.greedy
        and sp.logprobs is None
        and sp.presence_penalty == 0
        and sp.frequency_penalty == 0
        and sp.repetition_penalty == 1
        and len(req.output_token_ids) >= sp.min_tokens
        and not sp.logit_bias
        and not sp.allowed_token_ids
        and not sp.bad_words
        and req.grammar is None
    )


def _priority_key(req: Request) -> tuple[int, int]:
    return req.priority, req.order


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        cache: CacheConfig,
        num_pages: int,
        slot_buckets: tuple[int, ...] | None = None,
        slot_offset: int = 0,
        loras: LoRASlots | None = None,
        speculative: SpeculativeConfig | None = None,
    ):
        """config: the engine's (`EngineConfig.scheduler`: slots, chunk, token budget, policies),
        cache its KV pages' (page size, prefix caching). slot_offset: the first of this
        scheduler's config.num_slots slots (a data-parallel shard's, `data_parallel.py`); buckets
        count slots from it. loras: the device's adapter slots (LoRAConfig.enable_lora).
        speculative: the engine's speculative decoding (None: none)."""
        self.config = config
        self.speculative = speculative or SpeculativeConfig()
        self.slot_offset = slot_offset
        # Decode row buckets (the runner's): requests are packed into the lowest slots so a decode
        # step over the first B slots covers them all (`_compact`).
        self.slot_buckets = slot_buckets or (config.num_slots,)
        self.page_size = cache.page_size
        self.chunk = config.prefill_chunk_size
        self.max_prefill_rows = config.max_prefill_rows
        self.allocator = PageAllocator(num_pages)
        self.prefix_cache = PrefixCache(
            self.allocator, self.page_size, enabled=cache.enable_prefix_caching
        )
        self.admission: AdmissionPolicy
        if config.batching == "static":
            self.admission = StaticAdmission()
        else:
            self.admission = ContinuousAdmission(
                watermark=max(1, num_pages // 100),  # free pages kept back at admission
                page_size=self.page_size,
                wait_for_leader=cache.enable_prefix_caching,
            )
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # in admission order: the last one is preempted first
        self.free_slots = list(range(slot_offset, slot_offset + config.num_slots))
        self._released: list[int] = []
        self.num_preemptions = 0
        self.num_cached_tokens = 0  # prefill tokens taken from the prefix cache
        self.num_slot_moves = 0
        self.decode_rows_sum = 0  # row buckets of the decode steps planned, summed
        self.num_decode_plans = 0
        self.by_priority = config.scheduling_policy == "priority"
        self.num_added = 0
        self.loras = loras

    # -- queue ------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.num_added += 1
        request.order = self.num_added  # arrival order (children of one request in index order)
        self._enqueue(request)

    def _enqueue(self, request: Request, front: bool = False) -> None:
        """Into the waiting queue: at the back (front: a preempted request) under fcfs; under
        the priority policy at its place by (priority, arrival order)."""
        if not self.by_priority:
            self.waiting.appendleft(request) if front else self.waiting.append(request)
            return
        key = _priority_key(request)
        at = next((i for i, r in enumerate(self.waiting) if _priority_key(r) > key), None)
        self.waiting.insert(len(self.waiting) if at is None else at, request)

    def _victim(self) -> Request:
        """The running request preempted first: the newest (fcfs), or the lowest priority, then
        the newest (priority)."""
        if not self.by_priority:
            return self.running[-1]
        return max(self.running, key=_priority_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def reset_prefix_cache(self) -> bool:
        """Drops every cached prefix page (vLLM's `reset_prefix_cache`); False while requests
        are queued or running."""
        if self.has_unfinished():
            return False
        return self.prefix_cache.reset()

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Retires a request: its slot and pages are free for the very next plan."""
        request.status = status
        if request in self.running:
            self.prefix_cache.register(request)
            self.running.remove(request)
            self._free_resources(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def _release_lora(self, request: Request) -> None:
        if request.lora_slot >= 0:
            self.loras.release(request.lora_slot)
            request.lora_slot = -1

    def _free_resources(self, request: Request) -> None:
        # Last page first: cached pages are evicted least recently freed first, and a page is only
        # found through the pages before it, so a sequence's tail goes before its head (as vLLM).
        self.allocator.free(request.pages[::-1])
        request.pages = []
        request.block_uids = []
        self._release_lora(request)
        if request.slot is not None:
            self._released.append(request.slot)
            self.free_slots.append(request.slot)
            self.free_slots.sort()
            request.slot = None

    # -- planning ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        plan = SchedulerOutput(num_decode_steps=self.config.decode_steps)
        self._compact(plan)
        self._schedule_decodes(plan)
        rows_left = self._schedule_prefills(plan)
        self._admit(plan, rows_left)
        plan.released, self._released = self._released, []
        if self.loras is not None:
            plan.lora_loads = self.loras.take_loads()
        self._commit(plan)
        return plan

    def _compact(self, plan: SchedulerOutput) -> None:
        """Moves requests out of slots >= B into free lower slots when that lets the decode steps
        run over a smaller row bucket B (as requests retire, the survivors are scattered)."""
        held = [r for r in self.running if r.slot is not None]
        if not held:
            return
        target = bucket_for(len(held), self.slot_buckets) + self.slot_offset
        if max(r.slot for r in held) < target:
            return
        for req in sorted((r for r in held if r.slot >= target), key=lambda r: r.slot):
            dst = self.free_slots.pop(0)  # < target: at most target - #movers lower slots held
            plan.moves.append((req.slot, dst))
            self.num_slot_moves += 1
            self.free_slots.append(req.slot)
            req.slot = dst
        self.free_slots.sort()

    def _schedule_decodes(self, plan: SchedulerOutput) -> None:
        """Every running request past its prefill decodes, oldest first; a request that finds no
        page preempts the newest ones, itself last."""
        drafts = self.speculates()
        plan.speculative = drafts > 0
        if plan.speculative:
            plan.num_decode_steps = drafts + 1
        for req in list(self.running):
            if req.status != RequestStatus.RUNNING or not req.prefill_done:
                continue  # preempted by an older request earlier in this loop, or prefilling
            steps = min(plan.num_decode_steps, req.max_total_len - req.num_scheduled_tokens_total)
            if steps < 1:
                continue  # reaches its length limit with a step in flight; retired on its return
            if req.grammar is not None and req.num_pending_tokens:
                continue  # its grammar's next mask needs the token still in flight
            if self._grow(req, req.num_computed_tokens + steps, plan, self_preempt=True):
                plan.decode.append(req)

    def speculates(self) -> int:
        """The drafts a row proposes if the next plan's decode rows speculate, else 0: they do
        when the engine speculates, every decoding request is a plain greedy one
        (`can_speculate`), and the number of requests holding a slot leaves drafts
        (`SpeculativeConfig.draft_tokens`: the batch-size schedule and cap)."""
        if not self.speculative.num_speculative_tokens:
            return 0
        decoding = [r for r in self.running if r.prefill_done]
        if not decoding or not all(can_speculate(r) for r in decoding):
            return 0
        return self.speculative.draft_tokens(sum(r.slot is not None for r in self.running))

    def _schedule_prefills(self, plan: SchedulerOutput) -> int:
        """The next chunk of each running request with prefill left, oldest first, while chunk
        rows are left; returns the rows left for admission."""
        rows = self.max_prefill_rows
        for req in list(self.running):
            if rows == 0:
                break
            if req.status != RequestStatus.RUNNING or req.prefill_done:
                continue
            if self._schedule_chunk(req, plan):
                rows -= 1
        return rows

    def _admit(self, plan: SchedulerOutput, rows: int) -> None:
        """Waiting requests take free slots, oldest first, while the admission policy allows; each
        is planned its first chunk if a row is left (else at the next plan)."""
        if not self.admission.is_open(self.running):
            return
        skipped: list[Request] = []  # their adapter finds no device slot now (vLLM skips them)
        while self.waiting and self.free_slots and self.admission.wants_more(rows):
            req = self.waiting[0]
            if req.num_pending_tokens:
                break  # preempted with tokens in flight: re-prefill once they are known
            if self.admission.must_wait(req):
                break
            if req.lora is not None:
                req.lora_slot = self.loras.acquire(req.lora)
                if req.lora_slot is None:
                    req.lora_slot = -1
                    skipped.append(self.waiting.popleft())
                    continue
            req.begin_prefill()
            hits = self.prefix_cache.take(req)
            if not self.admission.fits(
                self.allocator, self._first_chunk_pages(req, hits), self.running
            ):
                self.allocator.free(hits)  # back to the cache, still evictable
                self._release_lora(req)
                break
            self._insert(req, hits, plan)
            if rows > 0 and self._schedule_chunk(req, plan):
                rows -= 1
        self.waiting.extendleft(reversed(skipped))

    def _first_chunk_pages(self, req: Request, hits: list[int]) -> int:
        """New pages `req`'s first chunk needs, past the cached pages `hits` it begins with."""
        start = len(hits) * self.page_size
        length = min(self.chunk, req.num_prefill_tokens - start)
        return pages_for(start + length, self.page_size) - len(hits)

    def _insert(self, req: Request, hits: list[int], plan: SchedulerOutput) -> None:
        """Moves the head of the queue into the lowest free slot, holding its cached pages."""
        self.waiting.popleft()
        req.status = RequestStatus.RUNNING
        req.slot = self.free_slots.pop(0)
        if hits:
            start = len(hits) * self.page_size
            req.pages = hits
            req.num_computed_tokens = req.num_cached_tokens = start
            self.num_cached_tokens += start
            plan.page_updates[req.slot] = list(hits)
        self.running.append(req)
        plan.inserted.append(req)

    def _commit(self, plan: SchedulerOutput) -> None:
        """Advances the planned requests as if the plan had run, so the next plan can be made
        while this one is still on the device (the tokens themselves arrive with its results)."""
        for req in plan.decode:
            steps = min(plan.num_decode_steps, req.max_total_len - req.num_scheduled_tokens_total)
            plan.decode_slots.append(req.slot)
            plan.decode_steps.append(steps)
            req.num_computed_tokens += steps
            req.num_pending_tokens += steps
        if plan.decode:
            rows = max(plan.decode_slots) - self.slot_offset + 1
            self.decode_rows_sum += bucket_for(rows, self.slot_buckets)
            self.num_decode_plans += 1
        for chunk in plan.prefill:
            req = chunk.request
            forced = chunk.is_last and req.forced_token is not None
            plan.forced.append(forced)
            req.num_computed_tokens += chunk.length
            if chunk.is_last and not forced:
                req.num_pending_tokens += 1
            self.prefix_cache.register(req)  # the full pages this chunk completes

    # -- pages ----------------------------------------------------------------------------------
    def _schedule_chunk(self, req: Request, plan: SchedulerOutput) -> bool:
        start = req.num_computed_tokens
        length = min(self.chunk, req.num_prefill_tokens - start)
        if not self._grow(req, start + length, plan, self_preempt=False):
            return False
        plan.prefill.append(
            PrefillChunk(req, start, length, start + length == req.num_prefill_tokens)
        )
        return True

    def _grow(
        self, req: Request, num_tokens: int, plan: SchedulerOutput, self_preempt: bool
    ) -> bool:
        """Gives `req` pages for `num_tokens` K/V tokens, preempting newer requests if needed.

        Returns False when `req` could not grow (it was preempted, or must wait this step).
        """
        need = pages_for(num_tokens, self.page_size) - len(req.pages)
        while need > self.allocator.num_free_pages:
            victim = self._victim()
            if victim is req:
                if self_preempt:
                    self._preempt(req, plan)
                return False
            self._preempt(victim, plan)
        if need > 0:
            req.pages.extend(self.allocator.allocate(need))
            plan.page_updates[req.slot] = list(req.pages)
        return True

    def _preempt(self, req: Request, plan: SchedulerOutput) -> None:
        """Recompute preemption: drop the K/V, keep the tokens, requeue at the front. With prefix
        caching its full pages stay cached (evictable), so the resumed request may find them."""
        self.prefix_cache.register(req)
        self.running.remove(req)
        plan.page_updates.pop(req.slot, None)
        if req in plan.decode:
            plan.decode.remove(req)
        plan.prefill = [c for c in plan.prefill if c.request is not req]
        if req in plan.inserted:
            plan.inserted.remove(req)
        self._free_resources(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        plan.preempted.append(req)
        self._enqueue(req, front=True)
