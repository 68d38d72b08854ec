"""Errors, limits and cancellation, as status codes and OpenAI's error object: bad input (invalid
JSON, unknown model, wrong types, out-of-range values, prompt too long, n too large, a body over
the limit) while another request streams on unaffected; auth; queue full (503 + Retry-After);
the request timeout; a non-streaming client that disconnects. The limits use an engine over the
fake runner, slowed down, so a request lasts as long as the test needs."""

from __future__ import annotations

import importlib.metadata
import threading
import time

import httpx
import openai
import pytest
from serving_testing import MAX_TOKENS, PROMPTS, ServerThread, fake_engine, wait_idle

from jaxserve.entrypoints.async_llm import AsyncLLM
from jaxserve.entrypoints.openai.server import build_app
from jaxserve.testing.fake_runner import FakeRunner


class _Slow(FakeRunner):
    # Cleared, the engine thread holds in fetch: no request can finish, so a test can hold the
    # engine in a known state however slow the machine is.
    gate = threading.Event()

    def fetch(self, handle):
        time.sleep(0.02)
        _Slow.gate.wait(30)
        return super().fetch(handle)


_Slow.gate.set()


@pytest.fixture(scope="module")
def slow():
    allm = AsyncLLM.from_engine(fake_engine(num_slots=1, runner_cls=_Slow))
    yield allm
    allm.shutdown()


def _serve(allm, **kw):
    return ServerThread(build_app(allm, "tiny", **kw))


def _post(url, body, **kw):
    return httpx.post(url, json=body, timeout=30, **kw) if not isinstance(body, bytes) else (
        httpx.post(url, content=body, timeout=30, headers={"content-type": "application/json"})
    )  # fmt: skip


def _error(r, status, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    return err


BASE = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4}


@pytest.mark.parametrize(
    "body, status, param",
    [
        (b"{not json", 400, None),
        ({**BASE, "model": "gpt-4"}, 404, "model"),
        ({**BASE, "max_tokens": "4"}, 400, "max_tokens"),
        ({**BASE, "temperature": "hot"}, 400, "temperature"),
        ({**BASE, "prompt": 5}, 400, "prompt"),
        ({**BASE, "prompt": []}, 400, "prompt"),
        ({**BASE, "prompt": [10**6]}, 400, "prompt"),
        ({**BASE, "top_p": 2.0}, 400, "top_p"),
        ({**BASE, "temperature": -1}, 400, "temperature"),
        ({**BASE, "logprobs": 50}, 400, "logprobs"),
        ({**BASE, "presence_penalty": 3}, 400, "presence_penalty"),
        ({**BASE, "n": 0}, 400, "n"),
        ({**BASE, "n": 33}, 400, "n"),  # more than the slots
        ({**BASE, "prompt": [5] * 64}, 400, "prompt"),  # max_model_len is 64
        ({**BASE, "prompt": [5] * 60, "max_tokens": 10}, 400, "max_tokens"),
        ({**BASE, "stop": "x"}, 400, "stop"),  # stop strings need a tokenizer
        ({"model": "tiny"}, 400, "prompt"),  # missing
    ],
)
def test_bad_input(tiny_server, body, status, param):
    _error(_post(f"{tiny_server.url}/completions", body), status, param)


def test_null_fields_take_their_defaults(tiny_server):
    # OpenAI's API and vLLM read a null as the field left out; many clients send every field
    fields = [
        "n", "stream", "stream_options", "echo", "logprobs", "presence_penalty",
        "frequency_penalty", "min_tokens", "ignore_eos", "stop", "seed", "top_k",
        "skip_special_tokens", "include_stop_str_in_output", "response_format", "user",
    ]  # fmt: skip
    body = {**BASE, "temperature": 0}
    want = _post(f"{tiny_server.url}/completions", body).json()["choices"]
    r = _post(f"{tiny_server.url}/completions", {**body, **dict.fromkeys(fields)})
    assert r.status_code == 200, r.text
    assert r.json()["choices"] == want
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "logprobs": None}
    assert _error(_post(f"{tiny_server.url}/chat/completions", chat), 400, "messages")
    _error(_post(f"{tiny_server.url}/completions", {**BASE, "prompt": None}), 400, "prompt")


def test_unknown_paths_and_methods_answer_with_the_error_object(tiny_server):
    err = _error(httpx.post(f"{tiny_server.url}/embeddings", json=BASE), 404)
    assert err["message"] == "Invalid URL (POST /v1/embeddings)"
    r = httpx.get(f"{tiny_server.url}/completions")
    assert "POST" in r.headers["allow"]
    assert "GET /v1/completions" in _error(r, 405)["message"]


def test_bad_input_does_not_affect_a_request_in_flight(tiny_server, offline):
    client = openai.OpenAI(base_url=tiny_server.url, api_key="none", max_retries=0)
    got = {}

    def stream():
        s = client.completions.create(
            model="tiny", prompt=PROMPTS[0], stream=True, temperature=0, max_tokens=MAX_TOKENS,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        got["ids"] = [t for c in s for ch in c.choices for t in ch.token_ids]

    t = threading.Thread(target=stream)
    t.start()
    for _ in range(5):
        _error(_post(f"{tiny_server.url}/completions", {**BASE, "top_p": 5.0}), 400, "top_p")
    t.join(60)
    assert got["ids"] == offline["greedy"][0].outputs[0].token_ids


def test_body_over_the_limit(tiny_async):
    server = _serve(tiny_async, max_body_bytes=1000)
    try:
        r = _post(f"{server.url}/completions", {**BASE, "prompt": [5] * 500})
        err = _error(r, 413)
        assert "1000" in err["message"]
    finally:
        server.stop()


def test_auth(tiny_async):
    server = _serve(tiny_async, api_key="sekrit")
    try:
        bad = openai.OpenAI(base_url=server.url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        r = httpx.post(f"{server.url}/completions", json=BASE)
        assert _error(r, 401)["type"] == "authentication_error"
        assert httpx.get(f"{server.base}/health").status_code == 200  # open
        version = importlib.metadata.version("jaxserve")
        assert httpx.get(f"{server.base}/version").json() == {"version": version}  # open
        good = openai.OpenAI(base_url=server.url, api_key="sekrit", max_retries=0)
        assert good.completions.create(model="tiny", prompt=[5, 6], max_tokens=2).choices
    finally:
        server.stop()


def _wait(cond, timeout=10):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_queue_full_is_503_with_retry_after(slow):
    server = _serve(slow, max_queued_requests=1)
    body = {"prompt": [3, 4], "max_tokens": 30, "ignore_eos": True}
    threads = []
    try:
        for _ in range(2):  # one takes the only slot, one waits
            threads.append(threading.Thread(target=_post, args=(f"{server.url}/completions", body)))
            threads[-1].start()
            _wait(lambda: slow.num_unfinished == len(threads))
            _wait(lambda: slow.stats()["num_running"] == 1)
            _Slow.gate.clear()  # the first request cannot finish and free its slot now
        _wait(lambda: slow.num_waiting >= 1)
        r = _post(f"{server.url}/completions", body)
        assert _error(r, 503)["type"] == "service_unavailable"
        assert r.headers["retry-after"] == "1"
    finally:
        _Slow.gate.set()
        for t in threads:
            t.join(30)
        server.stop()
    wait_idle(slow.engine)


def test_one_request_counts_its_prompts_and_samples_against_the_queue(slow):
    """Issue 58: one completion whose prompt is a list of 20,000 strings queued ~19,300 engine
    requests past max_queued_requests=1024. prompts x n now count: a request that can never fit
    is a 400 naming the field, one that does not fit now a 503, and nothing of it is queued."""
    server = _serve(slow, max_queued_requests=4)
    try:
        before = slow.num_unfinished
        many = {"prompt": [[3, 4]] * 5, "max_tokens": 2}
        assert (
            "max_queued_requests=4"
            in _error(_post(f"{server.url}/completions", many), 400, "prompt")["message"]
        )
        samples = {"prompt": [3, 4], "max_tokens": 2, "n": 5}
        _error(_post(f"{server.url}/completions", samples), 400, "n")
        assert slow.num_unfinished == before  # nothing was queued
        fits = {"prompt": [[3, 4]] * 3, "max_tokens": 2}
        r = _post(f"{server.url}/completions", fits)
        assert r.status_code == 200 and len(r.json()["choices"]) == 3
    finally:
        server.stop()
    wait_idle(slow.engine)


class _SlowTokenizer:
    """Two seconds a call (a sleep releases the GIL, as a tokenizer's native code mostly does)."""

    def __call__(self, text, add_special_tokens=True):
        time.sleep(2.0)
        return {"input_ids": [3] * min(len(text), 8)}


def test_a_long_tokenization_does_not_stall_other_clients():
    """Issue 58: a 7 MB prompt was tokenized on the event loop: /health went unanswered for
    seconds. Tokenizing runs in a worker thread now, and a prompt over the batch job's bound
    (4 Mi characters) is a 400 naming it before any tokenizing."""
    allm = AsyncLLM.from_engine(fake_engine())
    allm.tokenizer = _SlowTokenizer()
    server = _serve(allm)
    try:
        slow_call = threading.Thread(
            target=_post, args=(f"{server.base}/tokenize", {"model": "tiny", "prompt": "hello"})
        )
        slow_call.start()
        time.sleep(0.3)  # the tokenize request is in its tokenizer now
        t0 = time.monotonic()
        assert httpx.get(f"{server.base}/health", timeout=30).status_code == 200
        assert time.monotonic() - t0 < 1.0  # not behind the 2 s tokenization
        slow_call.join(30)
        t0 = time.monotonic()
        huge = {"model": "tiny", "prompt": "x" * ((4 << 20) + 1), "max_tokens": 1}
        err = _error(_post(f"{server.url}/completions", huge), 400, "prompt")
        assert "more than 4194304" in err["message"] and time.monotonic() - t0 < 1.9
    finally:
        server.stop()
        allm.shutdown()


def test_request_timeout(slow):
    server = _serve(slow, request_timeout_s=0.2)
    body = {"prompt": [3, 4], "max_tokens": 60, "ignore_eos": True}
    try:
        err = _error(_post(f"{server.url}/completions", body), 408)
        assert err["type"] == "timeout"
        wait_idle(slow.engine)
        with httpx.stream(
            "POST", f"{server.url}/completions", json={**body, "stream": True}, timeout=30
        ) as r:
            events = r.read().decode().split("\n\n")
        assert '"type":"timeout"' in events[-3] and events[-2] == "data: [DONE]"
    finally:
        server.stop()
    wait_idle(slow.engine)


def test_non_streaming_disconnect_aborts(slow):
    server = _serve(slow)
    body = {"prompt": [3, 4], "max_tokens": 60, "ignore_eos": True}
    steps = slow.engine.num_steps
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/completions", json=body, timeout=httpx.Timeout(5, read=0.3))
        wait_idle(slow.engine)
        assert slow.engine.num_steps - steps < 50  # it stopped well before its 60 tokens
    finally:
        server.stop()
