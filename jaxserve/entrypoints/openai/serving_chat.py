"""POST /v1/chat/completions: messages through the tokenizer's chat template, then one engine
request with n samples (`LLM.chat`'s tokenization: the template's text, no special tokens added).

max_tokens: `max_completion_tokens`, else `max_tokens`, else the room left in max_model_len (as
vLLM). `logprobs=true` returns each token's log-prob and `top_logprobs` alternatives. Tool calls
(`tools`, `tool_choice`, `parallel_tool_calls`): `tool_calls.ToolUse`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from jaxserve.core.outputs import CompletionOutput
from jaxserve.entrypoints.openai.protocol.chat import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    ChatTokenLogprob,
    DeltaMessage,
    DeltaToolCall,
    TopLogprob,
)
from jaxserve.entrypoints.openai.protocol.common import Usage, random_id
from jaxserve.entrypoints.openai.serving import (
    APIError,
    ServingState,
    check_prompt,
    check_prompt_chars,
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
    truncate,
)
from jaxserve.entrypoints.openai.tool_calls import ToolCallStream, ToolError, ToolUse
from jaxserve.inputs.chat import message_text, normalize_conversation, render_chat


def apply_template(
    state: ServingState,
    messages,
    add_generation_prompt: bool = True,
    kwargs=None,
    continue_final_message: bool = False,
    tools=None,
    chat_template: str | None = None,
) -> tuple[str, list[int]]:
    """(text, token ids) of a conversation (`render_chat`); 400 naming what is wrong. A request's
    own template (`chat_template`, or one in `kwargs`) needs --trust_request_chat_template, as
    in vLLM."""
    tok = state.tokenizer
    if tok is None:
        raise APIError(400, "chat needs a tokenizer; this model has none", "messages")
    asked = chat_template is not None or (kwargs or {}).get("chat_template") is not None
    if asked and not state.trust_request_chat_template:
        raise APIError(
            400,
            "Chat template is passed with request, but --trust_request_chat_template is not "
            "set. Refused request with untrusted chat template.",
            "chat_template",
        )
    if continue_final_message and add_generation_prompt:
        raise APIError(
            400,
            "continue_final_message and add_generation_prompt cannot both be true",
            "continue_final_message",
        )
    try:
        conv = normalize_conversation([m.model_dump(exclude_none=True) for m in messages])
    except ValueError as e:
        raise APIError(400, str(e), "messages") from None
    try:
        text, ids = render_chat(
            tok,
            conv,
            chat_template=chat_template if chat_template is not None else state.chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            chat_template_kwargs=kwargs,
        )
    except Exception as e:  # a template error is the caller's conversation
        raise APIError(400, f"chat template failed: {e}", "messages") from None
    check_prompt_chars(text, "messages")
    return text, ids


def _logprobs(state, c: CompletionOutput, start: int, k: int) -> ChatLogprobs:
    content = []
    for tid, entry in zip(c.token_ids[start:], (c.logprobs or [])[start:]):
        s = token_str(state, tid)
        top = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:k]  # Logprob values
        content.append(
            ChatTokenLogprob(
                token=s,
                logprob=clamp_logprob(entry[tid].logprob if tid in entry else float("-inf")),
                bytes=list(s.encode()),
                top_logprobs=[
                    TopLogprob(
                        token=token_str(state, t),
                        logprob=clamp_logprob(v.logprob),
                        bytes=list(token_str(state, t).encode()),
                    )
                    for t, v in top
                ],
            )
        )
    return ChatLogprobs(content=content)


async def create_chat_completion(state: ServingState, req: ChatCompletionRequest):
    """The response object, or (stream=True) an async iterator of SSE strings."""
    state.check_model(req.model)
    check_unserved(req)
    use = tool_use(state, req)
    kwargs = req.chat_template_kwargs
    if req.documents is not None:  # vLLM's: for templates that render documents (RAG)
        kwargs = {"documents": req.documents, **(kwargs or {})}
    text, ids = await off_loop(
        apply_template,
        state,
        req.messages,
        req.add_generation_prompt,
        kwargs,
        req.continue_final_message,
        req.tools,
        req.chat_template,
    )
    text, ids = truncate(state, req, text, ids)
    requested = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    max_tokens = check_prompt(state, ids, requested, state.max_model_len)
    k = req.top_logprobs or 0
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    fields = {}
    if use.constrains:
        fields["structured_outputs"] = {"json": use.schema}
    if use.mode == "auto":  # the parser reads the call markers, special tokens or not (as vLLM)
        fields["skip_special_tokens"] = False
    sp = make_sampling_params(
        state,
        req,
        max_tokens=max(max_tokens, 1),
        logprobs=k if req.logprobs else None,
        prompt_logprobs=req.prompt_logprobs,
        **fields,
    )
    await check_request(state, req, ids, sp)
    rid = random_id("chatcmpl")
    if req.stream:
        return sse_stream(_stream(state, req, text, ids, sp, rid, k, use))
    final = None
    async with deadline(state):
        async with contextlib.aclosing(
            generate_all(state, [(text, ids)], [sp], False, req.priority, req.model)
        ) as outs:
            async for _, out in outs:
                final = out
    echo = _echo(req)
    choices = []
    for c in final.outputs:
        content, calls = use.parse(c.text)
        if echo:
            content = echo + (content or "")
        choices.append(
            ChatChoice(
                index=c.index,
                message=ChatMessageOut(content=content, tool_calls=calls),
                logprobs=_logprobs(state, c, 0, k) if req.logprobs else None,
                finish_reason=use.finish_reason(c.finish_reason, bool(calls)),
                stop_reason=c.stop_reason,
                token_ids=c.token_ids,
            )
        )
    n_out = sum(len(c.token_ids) for c in final.outputs)
    usage = Usage(prompt_tokens=len(ids), completion_tokens=n_out, total_tokens=len(ids) + n_out)
    return ChatCompletionResponse(
        id=rid,
        model=state.answer_name(req.model),
        choices=choices,
        usage=usage,
        prompt_logprobs=prompt_logprobs_out(state, final),
    )


def _echo(req: ChatCompletionRequest) -> str:
    """vLLM's chat `echo`: the last message's text when it is the assistant's (the turn the
    reply continues), put before the reply; else nothing."""
    last = req.messages[-1]
    if not req.echo or last.role != "assistant":
        return ""
    return message_text(last.content)


def tool_use(state: ServingState, req: ChatCompletionRequest) -> ToolUse:
    """The request's tool use (`tool_calls.ToolUse`), or a 400 naming the field."""
    try:
        use = ToolUse.of(
            req.tools,
            req.tool_choice_given,
            req.parallel_tool_calls,
            state.tool_call_parser,
            state.enable_auto_tool_choice,
        )
    except ToolError as e:
        raise APIError(400, str(e), e.param) from None
    fmt = req.response_format
    if use.constrains and (req.structured_outputs is not None or (fmt and fmt.type != "text")):
        raise APIError(
            400,
            "You can only either use constraints for structured outputs or tools, not both.",
            "tool_choice",
        )
    return use


async def _stream(state, req, text, ids, sp, rid, k, use) -> AsyncIterator[str]:
    sent: dict[int, list] = {}  # choice index -> [tokens sent, tool-call view, finished]
    echo = _echo(req)
    usage = Usage(prompt_tokens=len(ids))

    def chunk(index, delta, lps=None, finish=None):
        c = ChatChunkChoice(index=index, delta=delta, logprobs=lps, finish_reason=finish)
        return sse(ChatCompletionChunk(id=rid, model=state.answer_name(req.model), choices=[c]))

    async with deadline(state):
        async with contextlib.aclosing(
            generate_all(state, [(text, ids)], [sp], True, req.priority, req.model)
        ) as outs:
            async for _, out in outs:
                for c in out.outputs:
                    if c.index not in sent:
                        sent[c.index] = [0, ToolCallStream(use), False]
                        yield chunk(c.index, DeltaMessage(role="assistant", content=""))
                        if echo:
                            yield chunk(c.index, DeltaMessage(content=echo))
                    s = sent[c.index]
                    if s[2]:
                        continue
                    done = c.finish_reason is not None
                    delta, calls = s[1].update(c.text, done)
                    lps = _logprobs(state, c, s[0], k) if req.logprobs else None
                    calls = [DeltaToolCall(**d) for d in calls] or None
                    if delta or calls or len(c.token_ids) > s[0] or done:
                        finish = use.finish_reason(c.finish_reason, s[1].calls > 0)
                        if use.mode != "none":
                            delta = delta or None  # a tool-call delta has no content
                        yield chunk(
                            c.index, DeltaMessage(content=delta, tool_calls=calls), lps, finish
                        )
                    s[0], s[2] = len(c.token_ids), done
                    if s[2]:
                        usage.completion_tokens += len(c.token_ids)
    if req.stream_options is not None and req.stream_options.include_usage:
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        yield sse(
            ChatCompletionChunk(id=rid, model=state.answer_name(req.model), choices=[], usage=usage)
        )
