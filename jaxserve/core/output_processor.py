"""Output processing on the host: one returned token at a time into text, log-probs, stop checks
and `RequestOutput`s (vLLM's output processor). Host only.

    RequestGroup               one user request: its n child `Request`s and their detokenizers
    append_token(...)          a generated token -> text (incremental detokenizer), log-prob
                               entries; returns the finish status if it hit a stop condition
    add_prompt_logprobs(...)   one prefill chunk's prompt log-probs into the request
    make_output(group)         -> RequestOutput (finished, or a streamed snapshot)

Stop conditions, checked per token once `min_tokens` are out: EOS (unless ignore_eos),
`stop_token_ids`, `stop` strings (ending after the first min_tokens tokens, as vLLM; the text is
cut before the stop string unless include_stop_str_in_output; streamed snapshots hold back a tail
that could start one), then `max_tokens` and `max_model_len` (finish_reason "length").
Log-prob entries are `Logprob`s with ranks and decoded tokens (`logprob_entry`).
"""

from __future__ import annotations

import dataclasses

from jaxserve.core.detokenizer import IncrementalDetokenizer, find_stop, held_back
from jaxserve.core.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.runner_api import PromptScores
from jaxserve.core.scheduler_output import PrefillChunk


@dataclasses.dataclass
class RequestGroup:
    """One user request: its n children and how it is reported."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    arrival_time: float
    stream: bool
    detokenizers: list[IncrementalDetokenizer | None]


def _decoded(tokenizer, token_id: int) -> str | None:
    return tokenizer.decode([token_id]) if tokenizer is not None else None


def logprob_entry(token: int, logprob: float, top, k: int, tokenizer) -> dict[int, Logprob]:
    """vLLM's dict for one position: the chosen `token` first, then the top-k (ranks 1..k).

    top: (ids, logprobs[, rank]) of the device's best MAX_LOGPROBS, best first, or None. The
    chosen token's rank is the number of tokens at least as likely, itself included (vLLM's >=
    count): the device's exact count over the vocabulary when given, else counted in the top
    entries (None when the token is not among them).
    """
    rank = None
    if top is not None and len(top) > 2 and top[2] is not None:
        rank = int(top[2])
    elif top is not None and len(top[1]):
        top_lps = [float(x) for x in top[1]]
        if logprob >= top_lps[-1] or token in (int(t) for t in top[0]):
            rank = sum(lp >= logprob for lp in top_lps)
    entry = {token: Logprob(logprob, rank, _decoded(tokenizer, token))}
    if top is not None:
        k = len(top[0]) if k == -1 else k  # -1: the whole vocabulary (the engine checked it fits)
        for r, (tid, lp) in enumerate(zip(top[0][:k], top[1][:k]), start=1):
            entry[int(tid)] = Logprob(float(lp), r, _decoded(tokenizer, int(tid)))
    return entry


def add_prompt_logprobs(
    req: Request, chunk: PrefillChunk, scores: PromptScores, row: int, tokenizer=None
) -> None:
    """Appends the log-prob entries of the prompt tokens chunk `row` of a step scored."""
    n_prompt = len(req.prompt_token_ids)
    k = req.sampling_params.prompt_logprobs
    for t in range(chunk.length):
        p = chunk.start + t  # the entry scores prompt token p + 1
        if p + 1 >= n_prompt:
            break
        target = req.prompt_token_ids[p + 1]
        top = scores.top.at(row, t)
        entry = logprob_entry(target, float(scores.logprobs[row, t]), top, k, tokenizer)
        req.prompt_logprobs.append(entry)


def append_token(
    req: Request,
    token: int,
    logprob: float,
    top,
    now: float,
    detok: IncrementalDetokenizer | None,
) -> RequestStatus | None:
    """Adds one generated token (top: (ids, logprobs) of the top log-probs, or None); returns the
    status to retire the request with if it hit a stop condition, else None."""
    sp = req.sampling_params
    req.output_token_ids.append(token)
    req.output_logprobs.append(logprob)
    req.cumulative_logprob += logprob
    if sp.logprobs is not None:
        tokenizer = detok.tokenizer if detok is not None else None
        req.top_logprobs.append(logprob_entry(token, logprob, top, sp.logprobs, tokenizer))
    if req.first_token_time is None:
        req.first_token_time = now

    status = None
    if len(req.output_token_ids) >= sp.min_tokens:
        if not sp.ignore_eos and token in req.eos_token_ids:
            status = RequestStatus.FINISHED_STOPPED
        elif sp.stop_token_ids and token in sp.stop_token_ids:
            status, req.stop_reason = RequestStatus.FINISHED_STOPPED, token
    # As vLLM: the text of a stop token (EOS or a stop_token_ids entry) that ends the request is
    # left out unless include_stop_str_in_output (with skip_special_tokens a special EOS has none).
    if status is None or sp.include_stop_str_in_output:
        new_text = detok.add(token) if detok is not None else ""
        req.text += new_text
        # vLLM: a stop string counts only once it ends past the first min_tokens tokens.
        if status is None and sp.stop and new_text and len(req.output_token_ids) > sp.min_tokens:
            hit = find_stop(req.text, len(new_text), sp.stop, sp.include_stop_str_in_output)
            if hit is not None:
                req.text = hit[0]
                status, req.stop_reason = RequestStatus.FINISHED_STOPPED, hit[1]
    if status is None and req.num_tokens >= req.max_total_len:
        status = RequestStatus.FINISHED_LENGTH
    if status is not None:
        req.finished_time = now
    return status


def make_output(group: RequestGroup) -> RequestOutput:
    """The group's RequestOutput: final once every child finished, else a streamed snapshot."""
    children = group.children
    outs = [
        CompletionOutput(
            index=c.index,
            # A snapshot of a running request holds back a possible stop-string start.
            text=c.text
            if c.status.finished or not c.sampling_params.stop
            else c.text[: len(c.text) - held_back(c.text, c.sampling_params.stop)],
            token_ids=list(c.output_token_ids),
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            logprobs=list(c.top_logprobs) if c.sampling_params.logprobs is not None else None,
            cumulative_logprob=c.cumulative_logprob
            if c.sampling_params.logprobs is not None
            else None,
        )
        for c in children
    ]
    firsts = [c.first_token_time for c in children if c.first_token_time is not None]
    ends = [c.finished_time for c in children if c.finished_time is not None]
    tpots = [
        (c.finished_time - c.first_token_time) / (len(c.output_token_ids) - 1)
        for c in children
        if c.finished_time is not None and len(c.output_token_ids) > 1
    ]
    metrics = RequestMetrics(
        arrival_time=group.arrival_time,
        first_token_time=min(firsts) if firsts else None,
        finished_time=max(ends) if len(ends) == len(children) else None,
        ttft=(min(firsts) - group.arrival_time) if firsts else None,
        tpot=sum(tpots) / len(tpots) if tpots else None,
        num_preemptions=sum(c.num_preemptions for c in children),
    )
    first = children[0]
    return RequestOutput(
        request_id=group.request_id,
        prompt=group.prompt,
        prompt_token_ids=list(group.prompt_token_ids),
        outputs=outs,
        finished=all(c.status.finished for c in children),
        metrics=metrics,
        prompt_logprobs=list(first.prompt_logprobs)
        if first.sampling_params.prompt_logprobs is not None
        else None,
        num_cached_tokens=sum(c.num_cached_tokens for c in children),
        error=next((c.error for c in children if c.error is not None), None),
    )
