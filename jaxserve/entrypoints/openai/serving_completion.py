"""POST /v1/completions: OpenAI's legacy completions, with vLLM's sampling extras.

One engine request per prompt (a str, a list of str, token ids, or a list of token-id lists);
choice `i * n + j` is sample j of prompt i. `echo` prepends the prompt (and, with `logprobs`, its
tokens' log-probs: the first is None). `max_tokens=0` is how lm-evaluation-harness scores
loglikelihood (echo + logprobs): SamplingParams needs max_tokens >= 1, so the engine generates one
token and only the prompt part is returned.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator

from jaxserve.core.outputs import CompletionOutput, RequestOutput
from jaxserve.entrypoints.openai.protocol.common import Usage, random_id
from jaxserve.entrypoints.openai.protocol.completion import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from jaxserve.entrypoints.openai.serving import (
    APIError,
    ServingState,
    check_prompt,
    check_request,
    check_unserved,
    clamp_logprob,
    deadline,
    generate_all,
    make_sampling_params,
    off_loop,
    prompt_logprobs_out,
    sse,
    sse_stream,
    token_str,
    tokenize_text,
    truncate,
)

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


def _prompts(state: ServingState, req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) per prompt, after truncate_prompt_tokens."""
    p, special = req.prompt, req.add_special_tokens
    if isinstance(p, str):
        prompts = [(p, tokenize_text(state, p, special))]
    elif not p:
        raise APIError(400, "prompt is empty", "prompt")
    elif all(isinstance(x, int) for x in p):
        prompts = [(None, list(p))]
    elif all(isinstance(x, str) for x in p):
        prompts = [(x, tokenize_text(state, x, special)) for x in p]
    else:
        prompts = [(None, list(x)) for x in p]
    return [truncate(state, req, text, ids) for text, ids in prompts]


class _Choices:
    """Turns one prompt's outputs into choice texts and log-prob tables, in full or as deltas."""

    def __init__(self, state: ServingState, req: CompletionRequest, prompt, max_tokens: int):
        self.state, self.req = state, req
        self.prompt_text, self.prompt_ids = prompt
        self.zero = max_tokens == 0  # return the prompt part only

    def prompt_part(self, out: RequestOutput) -> tuple[str, CompletionLogprobs | None]:
        if not self.req.echo:
            return "", None
        text = self.prompt_text
        if text is None:
            tok = self.state.tokenizer
            text = tok.decode(self.prompt_ids) if tok is not None else ""
        lps = None
        if self.req.logprobs is not None:
            entries = list(out.prompt_logprobs or [])
            if len(entries) < len(self.prompt_ids):
                entries = [None] * (len(self.prompt_ids) - len(entries)) + entries
            lps = self.table(self.prompt_ids, entries, 0)
        return text, lps

    def table(self, ids, entries, offset: int) -> CompletionLogprobs:
        lp = CompletionLogprobs()
        for tid, entry in zip(ids, entries):
            s = token_str(self.state, tid)
            lp.tokens.append(s)
            lp.text_offset.append(offset)
            offset += len(s)
            if entry is None:
                lp.token_logprobs.append(None)
                lp.top_logprobs.append(None)
                continue
            lp.token_logprobs.append(clamp_logprob(entry[tid].logprob) if tid in entry else None)
            # vLLM's table: the token itself plus the top `logprobs` (what lm-eval expects)
            lp.top_logprobs.append(
                {token_str(self.state, t): clamp_logprob(v.logprob) for t, v in entry.items()}
            )
        return lp

    def generated(self, c: CompletionOutput, tok0: int, chr0: int, offset: int):
        """(text, token ids, log-probs) of `c` from token tok0 / char chr0 on."""
        if self.zero:
            return "", [], None
        ids = c.token_ids[tok0:]
        lps = None
        if self.req.logprobs is not None:
            lps = self.table(ids, (c.logprobs or [])[tok0:], offset)
        return c.text[chr0:], ids, lps


def _merge(a: CompletionLogprobs | None, b: CompletionLogprobs | None):
    if a is None or b is None:
        return a or b
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        getattr(a, field).extend(getattr(b, field))
    return a


def _end(lps: CompletionLogprobs | None, default: int) -> int:
    """The text offset after a log-prob table (its tokens' strings laid end to end)."""
    if not lps or not lps.tokens:
        return default
    return lps.text_offset[-1] + len(lps.tokens[-1])


def _finish(c: CompletionOutput, zero: bool) -> str | None:
    if c.finish_reason is None:
        return None
    return "length" if zero else c.finish_reason


async def create_completion(state: ServingState, req: CompletionRequest):
    """The response object, or (stream=True) an async iterator of SSE strings."""
    state.check_model(req.model)
    check_unserved(req)
    prompts = await off_loop(_prompts, state, req)
    max_tokens = [
        check_prompt(state, ids, req.max_tokens, DEFAULT_MAX_TOKENS) for _, ids in prompts
    ]
    echo_lp = req.echo and req.logprobs is not None
    sp = make_sampling_params(
        state,
        req,
        max_tokens=max(max(max_tokens), 1),
        logprobs=req.logprobs,
        prompt_logprobs=req.prompt_logprobs
        if req.prompt_logprobs is not None
        else (req.logprobs if echo_lp else None),  # vLLM's order
    )
    sps = [dataclasses.replace(sp, max_tokens=max(m, 1)) for m in max_tokens]
    for (_, ids), prompt_sp in zip(prompts, sps):
        await check_request(state, req, ids, prompt_sp)
    choices = [_Choices(state, req, p, m) for p, m in zip(prompts, max_tokens)]
    rid = random_id("cmpl")
    if req.stream:
        return sse_stream(_stream(state, req, prompts, sps, choices, rid))
    return await _full(state, req, prompts, sps, choices, rid)


async def _full(state, req, prompts, sps, choices, rid) -> CompletionResponse:
    finals: dict[int, RequestOutput] = {}
    async with deadline(state):
        async with contextlib.aclosing(
            generate_all(state, prompts, sps, False, req.priority, req.model)
        ) as outs:
            async for i, out in outs:
                finals[i] = out
    result, usage = [], Usage()
    for i in range(len(prompts)):
        out, ch = finals[i], choices[i]
        usage.prompt_tokens += len(out.prompt_token_ids)
        ptext, plps = ch.prompt_part(out)
        prompt_lps = prompt_logprobs_out(state, out)
        for c in out.outputs:
            text, ids, lps = ch.generated(c, 0, 0, _end(plps, len(ptext)))
            usage.completion_tokens += len(c.token_ids)
            result.append(
                CompletionChoice(
                    index=i * req.n + c.index,
                    text=ptext + text,
                    logprobs=_merge(plps.model_copy(deep=True) if plps else None, lps),
                    finish_reason=_finish(c, ch.zero),
                    stop_reason=c.stop_reason,
                    token_ids=ids,
                    prompt_logprobs=prompt_lps,
                )
            )
    usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
    return CompletionResponse(
        id=rid, model=state.answer_name(req.model), choices=result, usage=usage
    )


async def _stream(state, req, prompts, sps, choices, rid) -> AsyncIterator[str]:
    sent: dict[int, list] = {}  # choice index -> [tokens sent, chars sent, offset, finished]
    usage = Usage()

    def chunk(index, text, lps, finish, ids):
        c = CompletionChoice(
            index=index, text=text, logprobs=lps, finish_reason=finish, token_ids=ids
        )
        return sse(CompletionResponse(id=rid, model=state.answer_name(req.model), choices=[c]))

    async with deadline(state):
        async with contextlib.aclosing(
            generate_all(state, prompts, sps, True, req.priority, req.model)
        ) as outs:
            async for i, out in outs:
                ch = choices[i]
                for c in out.outputs:
                    index = i * req.n + c.index
                    if index not in sent:
                        ptext, plps = ch.prompt_part(out)
                        sent[index] = [0, 0, _end(plps, len(ptext)), False]
                        if req.echo:
                            yield chunk(index, ptext, plps, None, [])
                    s = sent[index]
                    if s[3]:
                        continue
                    text, ids, lps = ch.generated(c, s[0], s[1], s[2])
                    finish = _finish(c, ch.zero)
                    if text or ids or finish:
                        yield chunk(index, text, lps, finish, ids)
                    s[0], s[1], s[3] = len(c.token_ids), len(c.text), finish is not None
                    s[2] += sum(len(t) for t in lps.tokens) if lps else len(text)
                    if finish is not None:
                        usage.completion_tokens += len(c.token_ids)
                if out.finished:
                    usage.prompt_tokens += len(out.prompt_token_ids)
    if req.stream_options is not None and req.stream_options.include_usage:
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        yield sse(
            CompletionResponse(id=rid, model=state.answer_name(req.model), choices=[], usage=usage)
        )
