"""What completions and chat completions share: the server's state, request checks, running the
engine requests of one HTTP request, log-prob formatting and the SSE wire format.

    state = ServingState(async_llm, model_name, ...)
    sp = make_sampling_params(state, req, max_tokens=..., logprobs=..., prompt_logprobs=...)
    async with aclosing(generate_all(state, prompts, sps, stream)) as outs:
        async for i, out in outs: ...        (prompt index, RequestOutput), as they arrive

Every check raises `APIError` (a status code and OpenAI's error object naming the field).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
from collections.abc import AsyncIterator

from jaxserve.core.outputs import RequestOutput
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.entrypoints.metrics import ServerMetrics
from jaxserve.entrypoints.openai.protocol.common import (
    ErrorInfo,
    ErrorResponse,
    PromptLogprob,
    random_id,
)

_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type
        self.code, self.headers = code, headers

    def body(self) -> dict:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()


@dataclasses.dataclass
class ServingState:
    async_llm: object  # AsyncLLM
    model_name: str
    metrics: ServerMetrics
    request_timeout_s: float | None = None
    chat_template: str | None = None
    max_n: int = 32
    tool_call_parser: str | None = None  # tool_calls.TOOL_CALL_PARSERS
    enable_auto_tool_choice: bool = False  # tool_choice="auto" (needs the parser)
    trust_request_chat_template: bool = False  # a request may bring its own chat template
    # LoRA adapters served by name (--lora_modules, /v1/load_lora_adapter): name -> LoRARequest
    loras: dict = dataclasses.field(default_factory=dict)

    @property
    def tokenizer(self):
        return self.async_llm.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.async_llm.engine_config.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.async_llm.model_config.vocab_size

    @property
    def generation_defaults(self) -> dict:
        """vLLM's server defaults from the model's generation_config.json (`LLM`'s
        generation_config="auto"): the values of its five sampler fields that a request leaving
        them unset gets."""
        sp = getattr(self.async_llm, "default_sampling_params", None)
        if sp is None:
            return {}
        base = SamplingParams()
        return {f: getattr(sp, f) for f in GENERATION_FIELDS if getattr(sp, f) != getattr(base, f)}

    def check_model(self, model: str | None):
        """The LoRARequest a request's `model` names (None for the base model); 404 for a name
        this server does not serve."""
        if model is None or model == self.model_name:
            return None
        if model in self.loras:
            return self.loras[model]
        raise APIError(404, f"The model `{model}` does not exist.", "model", code="model_not_found")

    def answer_name(self, model: str | None) -> str:
        """The `model` a response carries: the adapter's name, else the served model's."""
        return model if model in self.loras else self.model_name


def check_unserved(req) -> None:
    """400s for vLLM request fields whose meaning this server does not provide (ignoring them
    would answer another question than the one asked)."""
    if req.use_beam_search:
        raise APIError(400, "beam search is not supported by this server", "use_beam_search")
    if getattr(req, "suffix", None) is not None:
        raise APIError(
            400, "suffix is only supported for models with FIM completion rendering", "suffix"
        )
    if req.truncate_prompt_tokens == 0:
        raise APIError(
            400, "truncate_prompt_tokens must be -1 or at least 1", "truncate_prompt_tokens"
        )


def truncate(state: ServingState, req, text: str | None, ids: list[int]):
    """vLLM's truncate_prompt_tokens: (text, ids) of the prompt's last k tokens (-1:
    max_model_len); a prompt that lost tokens has no text (None), as a token-id prompt."""
    k = req.truncate_prompt_tokens
    if k is None or len(ids) <= (k := state.max_model_len if k == -1 else k):
        return text, ids
    return None, ids[-k:]


def check_prompt(state: ServingState, ids: list[int], max_tokens: int | None, default: int) -> int:
    """Checks one tokenized prompt; returns its max_tokens (the request's, else `default`,
    capped at the room left)."""
    if not ids:
        raise APIError(400, "prompt is empty", "prompt")
    if not all(0 <= t < state.vocab_size for t in ids):
        raise APIError(400, f"prompt token ids must be in [0, {state.vocab_size})", "prompt")
    room = state.max_model_len - len(ids)
    if room < 1:
        raise APIError(
            400,
            f"This model's maximum context length is {state.max_model_len} tokens; the prompt has "
            f"{len(ids)} tokens, leaving no room to generate.",
            "prompt",
        )
    if max_tokens is None:
        return min(default, room)
    if max_tokens > room:
        raise APIError(
            400,
            f"This model's maximum context length is {state.max_model_len} tokens. However, you "
            f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} "
            "in the completion).",
            "max_tokens",
        )
    return max_tokens


def clamp_logprob(logprob: float) -> float:
    """vLLM's server clamps log-probs at -9999.0: a masked token's -inf is not valid JSON."""
    return max(logprob, -9999.0)


def make_sampling_params(state: ServingState, req, **fields) -> SamplingParams:
    """SamplingParams of a request (its sampling fields plus `fields`); 400 naming a bad one."""
    if req.n > state.max_n:
        raise APIError(400, f"n must be at most {state.max_n}, got {req.n}", "n")
    if req.stream and req.prompt_logprobs not in (None, 0):  # as vLLM
        raise APIError(400, "prompt_logprobs are not available when stream=true", "prompt_logprobs")
    try:
        kw = {**req.sampling_kwargs(), **fields}
    except ValueError as e:
        raise APIError(400, str(e), req.structured_field) from None
    for name, value in state.generation_defaults.items():  # vLLM: only where the request is silent
        kw.setdefault(name, value)
    if kw.get("stop") and state.tokenizer is None:
        raise APIError(400, "stop strings need a tokenizer; use stop_token_ids", "stop")
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        word = str(e).split(" ", 1)[0]
        if word.startswith("structured_outputs"):
            raise APIError(400, str(e), req.structured_field) from None
        raise APIError(400, str(e), word if word in _SAMPLING_FIELDS else None) from None


async def check_request(state: ServingState, req, ids: list[int], sp: SamplingParams) -> None:
    """400 naming the field for what the engine would refuse (a token id outside the vocabulary,
    too many log-probs, a grammar that does not compile, ...), before any response starts: as
    vLLM's front end, a streamed request gets the status code, not an error event after 200.
    A grammar (whose validation, or the first one's tokenizer setup, can take a while) or
    bad_words is checked in a worker thread, so other clients' streams do not wait on it."""
    try:  # vLLM's `priority` extra: a ValueError under the fcfs policy
        state.async_llm.engine.checker.check_priority(getattr(req, "priority", 0))
    except ValueError as e:
        raise APIError(400, str(e), "priority") from None
    if sp.structured_outputs is not None or sp.bad_words:
        error = await asyncio.to_thread(state.async_llm.check, ids, sp)
    else:
        error = state.async_llm.check(ids, sp)
    if error is not None:
        param = _param_of(error, req.structured_field, req.prompt_logprobs is not None)
        if param == "logprobs" and hasattr(req, "top_logprobs"):  # a chat asks for k this way
            param = "top_logprobs"
        raise APIError(400, error, param)


# Longest text prompt or rendered conversation, in characters: the batch job's bound
# (`batch.job.RENDER_MAX_CHARS`); a longer one is a 400 before any tokenizing.
MAX_PROMPT_CHARS = 4 << 20


def check_prompt_chars(text: str, param: str) -> None:
    if len(text) > MAX_PROMPT_CHARS:
        raise APIError(
            400, f"{param} has {len(text)} characters, more than {MAX_PROMPT_CHARS}", param
        )


def tokenize_text(state: ServingState, text: str, add_special_tokens: bool = True) -> list[int]:
    """A text prompt's token ids (400 naming 'prompt' when too long or without a tokenizer).
    Callers on the event loop run it in a worker thread (`off_loop`): a long prompt's
    tokenizing must not stall every other client."""
    if state.tokenizer is None:
        raise APIError(400, "text prompts need a tokenizer; send token ids", "prompt")
    check_prompt_chars(text, "prompt")
    return list(state.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


async def off_loop(fn, *args, **kwargs):
    """fn(*args, **kwargs) in a worker thread: tokenizing and chat-template rendering, whose cost
    grows with the request, so /health and other clients' streams are answered meanwhile."""
    return await asyncio.to_thread(fn, *args, **kwargs)


def token_str(state: ServingState, token_id: int) -> str:
    """A token's text in log-prob tables (vLLM's "token_id:N" without a tokenizer)."""
    if state.tokenizer is None:
        return f"token_id:{token_id}"
    return state.tokenizer.decode([token_id])


async def generate_all(
    state: ServingState,
    prompts: list[tuple[str | None, list[int]]],
    sps: list,
    stream: bool,
    priority: int = 0,
    model: str | None = None,
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Runs one engine request per prompt (`sps`: its SamplingParams), with the LoRA adapter the
    request's `model` names, if any; yields (prompt index, output) as they arrive. Closing it
    aborts whatever is unfinished. An engine error output raises APIError (400)."""
    allm = state.async_llm
    base = random_id("cmpl")
    lora = state.check_model(model)
    gens = [
        allm.generate(
            {"prompt": t, "prompt_token_ids": ids},
            sp,
            f"{base}-{i}",
            stream,
            priority=priority,
            lora_request=lora,
        )
        for i, ((t, ids), sp) in enumerate(zip(prompts, sps))
    ]
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i, gen):
        try:
            async with contextlib.aclosing(gen):
                async for out in gen:
                    queue.put_nowait((i, out))
        except Exception as e:  # cancellation propagates: the generator aborts its request
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, end))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is end:
                remaining -= 1
            elif isinstance(item, Exception):
                raise APIError(500, f"engine error: {item}", type="internal_error")
            elif item.error is not None:
                raise APIError(400, item.error, _param_of(item.error))
            else:
                if item.finished:
                    state.metrics.observe(item)
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@contextlib.asynccontextmanager
async def deadline(state: ServingState):
    """The request's time limit (--request_timeout_s): 408 with the error object past it."""
    if state.request_timeout_s is None:
        yield
        return
    try:
        async with asyncio.timeout(state.request_timeout_s):
            yield
    except TimeoutError:
        raise APIError(
            408,
            f"request timed out after {state.request_timeout_s} s",
            type="timeout",
            code="request_timeout",
        ) from None


def sse(payload) -> str:
    """One server-sent event in OpenAI's wire format."""
    text = payload if isinstance(payload, str) else payload.model_dump_json()
    return f"data: {text}\n\n"


async def sse_stream(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """The SSE body: every event, `data: [DONE]`; an error mid-stream becomes an error event."""
    try:
        async with contextlib.aclosing(events):
            async for event in events:
                yield event
    except APIError as e:
        yield sse(ErrorResponse.model_validate(e.body()).model_dump_json())
    yield "data: [DONE]\n\n"


# vLLM's server applies generation_config.json to these when a request leaves them unset
# (`_DEFAULT_SAMPLING_PARAMS` in vllm/entrypoints/openai/protocol.py).
GENERATION_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _param_of(
    error: str, structured_field: str = "structured_outputs", asked_prompt_logprobs: bool = False
) -> str | None:
    """The request field an engine error starts with ("logprobs: requested ..." -> "logprobs",
    "logit_bias has token id(s) ..." -> "logit_bias"; a grammar's error names the field the
    request used), else "prompt" for the prompt's own errors."""
    m = re.match(r"(\w+)", error)
    word = m.group(1) if m else ""
    if word == "structured_outputs":
        return structured_field
    if word == "prompt_logprobs" and not asked_prompt_logprobs:
        return "logprobs"  # a completion's echo asks for them through `logprobs`
    if word in _SAMPLING_FIELDS:
        return word
    return "prompt" if "prompt" in error else None


def prompt_logprobs_out(state: ServingState, out) -> list | None:
    """A finished output's prompt log-probs as vLLM's server sends them (the first entry None;
    each position: token id -> logprob (clamped), rank, decoded_token), or None."""
    if out.prompt_logprobs is None:
        return None
    return [
        None
        if entry is None
        else {
            str(t): PromptLogprob(
                logprob=clamp_logprob(v.logprob), rank=v.rank, decoded_token=v.decoded_token
            )
            for t, v in entry.items()
        }
        for entry in out.prompt_logprobs
    ]
