"""OpenAI's `logit_bias` and vLLM's `allowed_token_ids` / `bad_words` request fields reach the
sampler (issue 25), on the tiny dummy model's server. vLLM's server clamps each bias to [-100, 100]
(`SamplingParams.from_optional`)."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
from serving_testing import PROMPTS


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=tiny_server.url, api_key="none", max_retries=0)


def test_logit_bias_and_allowed_token_ids(client):
    r = client.completions.create(
        model="tiny", prompt=PROMPTS[0], temperature=0, max_tokens=4,
        logit_bias={"77": 100}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert r.choices[0].token_ids == [77] * 4
    r = client.completions.create(
        model="tiny", prompt=PROMPTS[0], temperature=1.0, seed=3, max_tokens=8,
        extra_body={"allowed_token_ids": [9, 10, 11]},
    )  # fmt: skip
    assert set(r.choices[0].token_ids) <= {9, 10, 11}


def test_bad_fields_are_400_naming_them(tiny_server):
    base = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 2}
    for extra, param in (
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"temperature": 2.5}, "temperature"),
    ):
        r = httpx.post(f"{tiny_server.url}/completions", json={**base, **extra}, timeout=60)
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"] == param, r.text
    # past the vocabulary (128), bad_words without a tokenizer, more log-probs than allowed:
    # only the engine knows; the server asks it before answering, so a streamed request gets the
    # 400 too (not an error event after 200, as vLLM's front end)
    for extra, param in (
        ({"logit_bias": {"500": 1.0}}, "logit_bias"),
        ({"allowed_token_ids": [9, 999]}, "allowed_token_ids"),
        ({"bad_words": ["x"]}, "bad_words"),
        ({"logprobs": 50}, "logprobs"),
        ({"echo": True, "logprobs": 50, "max_tokens": 0}, "logprobs"),
    ):
        for stream in (False, True):
            body = {**base, **extra, "stream": stream}
            r = httpx.post(f"{tiny_server.url}/completions", json=body, timeout=60)
            assert r.status_code == 400, (extra, stream, r.text)
            assert r.json()["error"]["param"] == param, r.text


def test_a_slow_request_check_does_not_hold_other_clients(tiny_server, tiny_async, monkeypatch):
    """A grammar's check (validation; the first one also builds llguidance's tokenizer) runs in a
    worker thread: while one is held, another client's request is answered, then the held one
    gets its 400."""
    entered, gate, checked = threading.Event(), threading.Event(), threading.Event()
    real = tiny_async.check

    def slow(ids, sp):
        if sp.structured_outputs is not None:
            entered.set()
            gate.wait(20)
            checked.set()
        return real(ids, sp)

    monkeypatch.setattr(tiny_async, "check", slow)
    url = f"{tiny_server.url}/completions"
    base = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 2}
    held = {}
    body = {**base, "structured_outputs": {"regex": "a+"}}
    t = threading.Thread(target=lambda: held.update(r=httpx.post(url, json=body, timeout=60)))
    t.start()
    try:
        assert entered.wait(20)  # the held request is in its check
        r = httpx.post(url, json=base, timeout=60)
        assert r.status_code == 200 and not checked.is_set()
    finally:
        gate.set()
        t.join(60)
    assert held["r"].status_code == 400, held["r"].text  # the tiny model has no tokenizer
    assert held["r"].json()["error"]["param"] == "structured_outputs"
