"""`AsyncLLM`: the engine behind an asyncio API, for the HTTP server and notebooks.

    allm = AsyncLLM.from_llm(LLM("tiny", load_format="dummy"))     # or AsyncLLM(**settings)
    async for out in allm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(), "req-0"):
        ...                                     # cumulative snapshots; the last is finished

Threads and queues (the device loop never waits on an asyncio caller):

    caller (any event loop)                    engine thread ("jaxserve-engine", one)
    generate(): outbox[rid] = (loop, Queue)
      inbox.append(("add", ...)); notify  ───►  wakes (sleeps on a Condition while idle)
                                               applies every queued add / abort, in order
                                               outs = engine.step()
      await queue.get()  ◄── call_soon_threadsafe(queue.put_nowait, out)   per output
    generate() closed early (aclose, a cancelled task, a client gone):
      abort(rid) -> inbox.append(("abort", rid)) ──► engine.abort(rid): slot and pages free
                                                      at the next step

An exception in the engine thread fails every in-flight request (its queue gets `EngineDeadError`)
and every later `generate` raises it, so nothing hangs. `stats()` is a snapshot the engine thread
takes after each step, safe to read from any thread.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from jaxserve.core.outputs import RequestOutput
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.inputs.prompts import parse_prompt

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an exception; requests in flight and new ones fail with it."""


class AsyncLLM:
    """An `LLMEngine` driven by one background thread; `generate` is an async iterator.

    `AsyncLLM(model, **settings)` builds its engine as `LLM` does (`engine_args.build_engine`: the
    same arguments, vLLM's spellings and defaults);
    `AsyncLLM.from_llm(llm)` wraps one already built; `AsyncLLM.from_engine(engine)` wraps any
    `LLMEngine` (e.g. over the fake runner in tests).
    """

    def __init__(self, model=None, **settings):
        from jaxserve.engine_args import build_engine  # lazy: building an engine loads jax

        built = build_engine(model, **settings)  # LLM's build path, its arguments and defaults
        self._init(built.engine, built.tokenizer)
        self.default_sampling_params = built.default_sampling_params

    @classmethod
    def from_llm(cls, llm) -> AsyncLLM:
        self = cls.from_engine(llm.engine, llm.tokenizer)
        self.default_sampling_params = llm.default_sampling_params  # generation_config.json's
        return self

    @classmethod
    def from_engine(cls, engine, tokenizer=None) -> AsyncLLM:
        self = cls.__new__(cls)
        self._init(engine, tokenizer if tokenizer is not None else engine.tokenizer)
        return self

    def _init(self, engine, tokenizer) -> None:
        self.default_sampling_params = None  # SamplingParams from the model's generation_config
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_config = engine.model_config
        self.engine_config = engine.config
        self._cond = threading.Condition()
        self._inbox: list[tuple] = []  # ("add", rid, text, ids, sp, stream, t) | ("abort", rid)
        self._outbox: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._stopping = False
        self._dead: BaseException | None = None
        self._stats: dict[str, Any] = engine.stats()
        self._pending_adds = 0  # submitted, not yet handed to the engine
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()

    # -- the caller's side ------------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self._dead is None and not self._stopping

    @property
    def num_unfinished(self) -> int:
        """Requests submitted through `generate` and not yet finished or aborted."""
        return len(self._outbox)

    @property
    def num_waiting(self) -> int:
        """Requests not yet admitted to a slot: queued for the engine, or in its waiting queue."""
        return self._pending_adds + self._stats["num_waiting"]

    def stats(self) -> dict[str, Any]:
        """The engine's counters (`LLMEngine.stats()`) plus `num_used_pages`, as of the last step."""
        return dict(self._stats)

    def parse_prompt(self, prompt) -> tuple[str | None, list[int]]:
        """(text, token ids) of one prompt, by `LLM`'s rules (`inputs.prompts.parse_prompt`);
        ValueError (`PromptError`) naming the problem."""
        return parse_prompt(prompt, self.tokenizer)

    def check(self, prompt_token_ids: list[int], sampling_params: SamplingParams) -> str | None:
        """The reason the engine would refuse this request, or None, found now in the caller's
        thread (`RequestChecker.check_request`): a server answers 400 before a stream starts."""
        return self.engine.checker.check_request(prompt_token_ids, sampling_params)[1]

    async def generate(
        self,
        prompt,
        sampling_params: SamplingParams | dict | None = None,
        request_id: str | None = None,
        stream: bool = True,
        priority: int = 0,
        lora_request=None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs: a snapshot each step it gains tokens (stream=True) and
        finally the finished output (only that one with stream=False). A bad prompt or bad
        parameters yield one finished output with `error` set. Closing the iterator early aborts
        the request. priority: lower runs first under scheduling_policy="priority" (ValueError
        under fcfs, as vLLM). lora_request: the request's `jaxserve.lora.LoRARequest` (needs
        enable_lora; an adapter that cannot be used is the request's error output)."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine thread failed: {self._dead!r}") from self._dead
        if self._stopping:
            raise EngineDeadError("the engine is shutting down")
        rid = request_id if request_id is not None else f"async-{next(self._ids)}"
        if rid in self._outbox:
            raise ValueError(f"request_id {rid!r} is already running")
        self.engine.checker.check_priority(priority)  # reads only the config: safe from this thread
        now = time.monotonic()
        try:
            sp = sampling_params if sampling_params is not None else SamplingParams()
            sp = SamplingParams.from_dict(sp) if isinstance(sp, dict) else sp
            text, ids = self.parse_prompt(prompt)
        except (ValueError, TypeError) as e:
            yield RequestOutput.from_error(rid, None, [], str(e), now)
            return
        queue: asyncio.Queue = asyncio.Queue()
        self._outbox[rid] = (asyncio.get_running_loop(), queue)
        finished = False
        try:
            self._post(("add", rid, text, ids, sp, stream, now, priority, lora_request))
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._outbox.pop(rid, None)
            if not finished:
                self._post(("abort", rid))

    def abort(self, request_id: str) -> None:
        """Stops a request (from any thread); its generator ends without a finished output."""
        self._post(("abort", request_id))

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stops the engine thread after its current step; in-flight requests fail."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    def _post(self, command: tuple) -> None:
        with self._cond:
            if command[0] == "add":
                self._pending_adds += 1
            self._inbox.append(command)
            self._cond.notify()

    # -- the engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._cond:
                    while not self._inbox and not self._stopping and not engine.has_unfinished():
                        engine.drain()  # a step left in flight after the last request finished
                        self._snapshot()
                        self._cond.wait()
                    if self._stopping:
                        break
                    commands, self._inbox = self._inbox, []
                for command in commands:
                    self._apply(command)
                if engine.has_unfinished():
                    for out in engine.step():
                        self._deliver(out.request_id, out)
                self._snapshot()
        except BaseException as e:  # fail everything in flight rather than hang it
            logger.exception("engine thread failed")
            self._dead = e
        error = self._dead or EngineDeadError("the engine was shut down")
        with self._cond:
            self._pending_adds = 0
            self._inbox.clear()
        for rid in list(self._outbox):
            self._deliver(rid, EngineDeadError(f"engine stopped: {error!r}"))

    def _apply(self, command: tuple) -> None:
        if command[0] == "abort":
            self.engine.abort(command[1])
            return
        _, rid, text, ids, sp, stream, now, priority, lora = command
        with self._cond:
            self._pending_adds -= 1
        if rid not in self._outbox:
            return  # its caller went away before the engine saw it
        try:
            self.engine.add_request(
                rid,
                text,
                ids,
                sp,
                stream=stream,
                arrival_time=now,
                priority=priority,
                lora_request=lora,
            )
        except ValueError as e:
            self._deliver(rid, RequestOutput.from_error(rid, text, ids, str(e), now, sp.n))

    def _deliver(self, rid: str, item) -> None:
        target = self._outbox.get(rid)
        if target is None:
            return  # aborted: the abort is already queued
        loop, queue = target
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed
            self.engine.abort(rid)

    def _snapshot(self) -> None:
        stats = self.engine.stats()
        stats["num_used_pages"] = self.engine.scheduler.allocator.num_used_pages
        self._stats = stats
