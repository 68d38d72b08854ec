"""The real `openai` client (sync and async, streaming and not) against the server on the tiny
dummy model (token-id prompts: it has no tokenizer). Completions equal LLM.generate token for
token; streamed deltas join into the full output; n, seed, stop_token_ids, logprobs, echo and
max_tokens=0 (lm-eval's loglikelihood); 64 concurrent streams, then 64 of which half disconnect;
/v1/models, /health, /metrics, tokenize without a tokenizer."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from serving_testing import MAX_TOKENS, PROMPTS, wait_idle

GREEDY = dict(temperature=0, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=tiny_server.url, api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def aclient_url(tiny_server):
    return tiny_server.url


def _ids(out):
    return out.outputs[0].token_ids


def test_completion_equals_llm_generate(client, offline):
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], **GREEDY)
    assert r.choices[0].token_ids == _ids(offline["greedy"][0])
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(PROMPTS[0])
    assert r.usage.completion_tokens == MAX_TOKENS
    # a list of token-id prompts: choice i is prompt i
    r = client.completions.create(model="tiny", prompt=PROMPTS[1:4], **GREEDY)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.token_ids for c in r.choices] == [_ids(o) for o in offline["greedy"][1:4]]


def test_stream_deltas_join_into_the_full_output(client, offline):
    stream = client.completions.create(
        model="tiny", prompt=PROMPTS[0], stream=True, stream_options={"include_usage": True},
        **GREEDY,
    )  # fmt: skip
    chunks = list(stream)
    ids = [t for c in chunks for ch in c.choices for t in ch.token_ids]
    assert ids == _ids(offline["greedy"][0])
    assert [ch.finish_reason for c in chunks for ch in c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_sse_wire_format(tiny_server):
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 2, "stream": True}
    # a generous timeout: the step may compile on a loaded machine (httpx waits 5 s by default)
    with httpx.stream("POST", f"{tiny_server.url}/completions", json=body, timeout=120) as r:
        text = r.read().decode()
    assert r.headers["content-type"].startswith("text/event-stream")
    events = text.split("\n\n")
    assert all(e.startswith("data: ") for e in events if e)
    assert events[-2] == "data: [DONE]"


def test_n_and_seed(client, offline):
    kw = dict(model="tiny", n=3, seed=7, temperature=1.0, max_tokens=MAX_TOKENS)
    kw["extra_body"] = {"ignore_eos": True}
    r = client.completions.create(prompt=PROMPTS[:2], **kw)
    assert [c.index for c in r.choices] == list(range(6))
    want = [c.token_ids for o in offline["sampled"] for c in o.outputs]
    assert [c.token_ids for c in r.choices] == want
    assert len({tuple(t) for t in want[:3]}) > 1  # the n samples differ
    again = client.completions.create(prompt=PROMPTS[:2], **kw)
    assert [c.token_ids for c in again.choices] == want


def test_stop_token_ids(client, offline):
    full = _ids(offline["greedy"][0])
    stop = full[3]
    r = client.completions.create(
        model="tiny", prompt=PROMPTS[0], temperature=0, max_tokens=MAX_TOKENS,
        extra_body={"ignore_eos": True, "stop_token_ids": [stop]},
    )  # fmt: skip
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.token_ids == full[: full.index(stop) + 1]


def test_logprobs_and_echo(client, offline):
    ref = offline["logprobs"][0]
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], logprobs=2, **GREEDY)
    lp = r.choices[0].logprobs
    out = ref.outputs[0]
    assert lp.tokens == [f"token_id:{t}" for t in out.token_ids]
    assert lp.token_logprobs == pytest.approx(
        [e[t].logprob for t, e in zip(out.token_ids, out.logprobs)]
    )
    assert all(len(top) >= 2 for top in lp.top_logprobs)
    # echo + logprobs + max_tokens=0: the prompt's log-probs (lm-eval's loglikelihood)
    r = client.completions.create(
        model="tiny", prompt=PROMPTS[0], echo=True, logprobs=1, max_tokens=0, temperature=0
    )
    lp = r.choices[0].logprobs
    p = PROMPTS[0]
    assert r.choices[0].token_ids == [] and len(lp.tokens) == len(p)
    assert lp.token_logprobs[0] is None
    want = [e[t].logprob for t, e in zip(p[1:], ref.prompt_logprobs[-(len(p) - 1) :])]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-5)
    # echo with generation: the prompt's entries, then the generated ones
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], echo=True, logprobs=1, **GREEDY)
    assert len(r.choices[0].logprobs.tokens) == len(p) + MAX_TOKENS


def test_truncate_prompt_tokens_and_what_is_not_served(client, offline):
    """vLLM's truncate_prompt_tokens keeps the prompt's last k tokens (so a long prefix in front
    of PROMPTS[0] gives PROMPTS[0]'s output); fields whose meaning is not served (FIM suffix,
    beam search, a priority under the fcfs policy) are 400s naming them, not ignored."""
    p = PROMPTS[0]
    long = [7] * 30 + p
    r = client.completions.create(
        model="tiny", prompt=long, extra_body={"truncate_prompt_tokens": len(p), "ignore_eos": True},
        temperature=0, max_tokens=MAX_TOKENS,
    )  # fmt: skip
    assert r.choices[0].token_ids == _ids(offline["greedy"][0])
    assert r.usage.prompt_tokens == len(p)
    r = client.completions.create(
        model="tiny", prompt=p, max_tokens=2, extra_body={"truncate_prompt_tokens": -1}
    )
    assert r.usage.prompt_tokens == len(p)  # -1: up to max_model_len
    bad = [
        ({"suffix": "x"}, "suffix"),
        ({"extra_body": {"use_beam_search": True}}, "use_beam_search"),
        ({"extra_body": {"truncate_prompt_tokens": 0}}, "truncate_prompt_tokens"),
        ({"extra_body": {"truncate_prompt_tokens": -2}}, "truncate_prompt_tokens"),
        ({"extra_body": {"priority": 1}}, "priority"),  # vLLM: only with the priority policy
    ]
    for extra, param in bad:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as e:
                client.completions.create(
                    model="tiny", prompt=p, max_tokens=2, stream=stream, **extra
                )
            assert e.value.body["param"] == param, e.value.body


def test_add_special_tokens_reaches_the_tokenizer():
    """vLLM's add_special_tokens for text prompts (default true), and a truncated text prompt's
    text is its kept tokens' decoding."""
    from types import SimpleNamespace

    from jaxserve.entrypoints.openai.protocol.completion import CompletionRequest
    from jaxserve.entrypoints.openai.serving_completion import _prompts

    class Tok:
        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": ([1] if add_special_tokens else []) + [ord(c) for c in text]}

        def decode(self, ids):
            return "".join(chr(i) for i in ids)

    state = SimpleNamespace(tokenizer=Tok(), max_model_len=64)
    state.async_llm = SimpleNamespace(tokenizer=state.tokenizer)

    def prompts(**body):
        return _prompts(state, CompletionRequest.model_validate({"prompt": "ab", **body}))

    assert prompts() == [("ab", [1, 97, 98])]
    assert prompts(add_special_tokens=False) == [("ab", [97, 98])]
    assert prompts(truncate_prompt_tokens=2) == [(None, [97, 98])]
    assert prompts(truncate_prompt_tokens=3) == [("ab", [1, 97, 98])]


def test_vllm_prompt_logprobs_extra(client, offline):
    """vLLM's `prompt_logprobs` extra: each choice (chat: the response) carries every prompt
    token's top-n plus the token itself, with ranks, the first None; streaming refuses it."""
    ref = offline["logprobs"][0].prompt_logprobs  # prompt_logprobs=2
    kw = dict(temperature=0, max_tokens=MAX_TOKENS)
    r = client.completions.create(
        model="tiny", prompt=PROMPTS[0], extra_body={"ignore_eos": True, "prompt_logprobs": 2}, **kw
    )
    got = r.choices[0].model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ref) == len(PROMPTS[0])
    for entry, want in zip(got[1:], ref[1:]):
        assert {int(t) for t in entry} == set(want)
        for t, v in want.items():
            assert entry[str(t)]["logprob"] == pytest.approx(v.logprob, abs=1e-5)
            assert entry[str(t)]["rank"] == v.rank
    assert r.choices[0].logprobs is None  # echo's table only with echo + logprobs
    plain = client.completions.create(model="tiny", prompt=PROMPTS[0], **GREEDY)
    assert plain.choices[0].model_extra.get("prompt_logprobs") is None
    assert plain.choices[0].text == r.choices[0].text
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model="tiny", prompt=PROMPTS[0], stream=True, extra_body={"prompt_logprobs": 1}
        )
    assert e.value.body["param"] == "prompt_logprobs"
    with pytest.raises(openai.BadRequestError) as e:  # more than max_logprobs (20)
        client.completions.create(
            model="tiny", prompt=PROMPTS[0], extra_body={"prompt_logprobs": 50}
        )
    assert e.value.body["param"] == "prompt_logprobs"


def test_async_client_64_concurrent_streams_equal_offline(tiny_server, tiny_async, offline):
    async def one(client, i):
        stream = await client.completions.create(
            model="tiny", prompt=PROMPTS[i], stream=True, **GREEDY
        )
        return [t async for c in stream for ch in c.choices for t in ch.token_ids]

    async def main():
        async with openai.AsyncOpenAI(
            base_url=tiny_server.url, api_key="none", max_retries=0,
            http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=64), timeout=120),
        ) as client:  # fmt: skip
            full = await client.completions.create(model="tiny", prompt=PROMPTS[5], **GREEDY)
            assert full.choices[0].token_ids == _ids(offline["greedy"][5])
            return await asyncio.gather(*[one(client, i) for i in range(64)])

    got = asyncio.run(main())
    assert got == [_ids(o) for o in offline["greedy"]]
    wait_idle(tiny_async.engine)


def test_half_of_64_streams_disconnect(tiny_server, tiny_async, offline):
    url = f"{tiny_server.url}/completions"

    async def one(http, i):
        body = {"model": "tiny", "prompt": PROMPTS[i], "stream": True, "temperature": 0}
        body |= {"max_tokens": MAX_TOKENS if i % 2 else 40, "ignore_eos": True}
        ids = []
        async with http.stream("POST", url, json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                ids += __import__("json").loads(line[6:])["choices"][0]["token_ids"]
                if i % 2 == 0 and len(ids) >= 2:
                    return None  # leaves the stream: the connection closes mid-stream
        return ids

    async def main():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(limits=limits, timeout=120) as http:
            return await asyncio.gather(*[one(http, i) for i in range(64)])

    got = asyncio.run(main())
    for i in range(1, 64, 2):
        assert got[i] == _ids(offline["greedy"][i])
    wait_idle(tiny_async.engine)
    assert tiny_async.engine.scheduler.allocator.num_used_pages == 0


def test_models_health_metrics(client, tiny_server):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert client.models.retrieve("tiny").max_model_len == models.data[0].max_model_len
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("org/gpt-4")
    assert e.value.body["code"] == "model_not_found"
    assert httpx.get(f"{tiny_server.base}/health").status_code == 200
    client.completions.create(model="tiny", prompt=PROMPTS[0], **GREEDY)
    text = httpx.get(f"{tiny_server.base}/metrics").text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:time_per_output_token_seconds_bucket",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:num_preemptions_total",
        "vllm:prefix_cache_hits_total",
    ):
        assert name in text, name


def test_no_tokenizer_endpoints_say_so(client, tiny_server):
    r = httpx.post(f"{tiny_server.base}/tokenize", json={"prompt": "hi"})
    assert r.status_code == 400 and "tokenizer" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
    assert e.value.body["param"] == "messages"
