"""The server's defaults from the model's generation_config.json, as vLLM's server applies them
(`_DEFAULT_SAMPLING_PARAMS` in vllm/entrypoints/openai/protocol.py): temperature, top_p, top_k,
min_p and repetition_penalty come from the file when a request leaves them unset, and a request's
own value always wins; other fields keep the API's defaults."""

from __future__ import annotations

from types import SimpleNamespace

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.entrypoints.openai.protocol.chat import ChatCompletionRequest
from jaxserve.entrypoints.openai.protocol.completion import CompletionRequest
from jaxserve.entrypoints.openai.serving import ServingState, make_sampling_params

GEN = SamplingParams(temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.1,
                     presence_penalty=0.5, max_tokens=7)  # fmt: skip


def state(defaults):
    fake = SimpleNamespace(default_sampling_params=defaults, tokenizer=None)
    return ServingState(fake, "m", metrics=None)


def test_unset_fields_take_the_generation_config():
    sp = make_sampling_params(state(GEN), CompletionRequest(prompt=[1, 2]))
    assert (sp.temperature, sp.top_p, sp.top_k, sp.repetition_penalty) == (0.6, 0.9, 20, 1.1)
    assert sp.presence_penalty == 0.0  # not one of vLLM's five: the API's default


def test_a_requests_own_values_win():
    req = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}], temperature=1.0, top_k=-1
    )
    sp = make_sampling_params(state(GEN), req)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.repetition_penalty) == (1.0, 0.9, -1, 1.1)


def test_no_generation_config_keeps_the_api_defaults():
    for defaults in (None, SamplingParams()):
        sp = make_sampling_params(state(defaults), CompletionRequest(prompt=[1]))
        assert (sp.temperature, sp.top_p, sp.top_k) == (1.0, 1.0, 0)
