"""The server on the real SmolLM2-135M-Instruct: text completions and chat equal LLM.generate /
LLM.chat token for token (sync and async clients, streaming and not), streamed deltas join into
the full text, stop strings, chat log-probs, /tokenize and /detokenize."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools

import httpx
import openai
import pytest
from serving_testing import ServerThread, wait_idle

from jaxserve import SamplingParams
from jaxserve.entrypoints.openai.tool_calls import ToolUse
from jaxserve.testing.lm_eval_tasks import (
    score_with_local_completions,
    write_multiple_choice_task,
)

pytestmark = pytest.mark.smollm2

KW = dict(dtype="float32", num_slots=4, max_model_len=256)
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]
PARTIAL = CHAT + [{"role": "assistant", "content": "The three colors are"}]
N = 12
PARTS = [{"type": "text", "text": "Name three"}, {"type": "text", "text": "colors."}]
JSON_CHAT = [{"role": "user", "content": "Give a person as JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER_CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"], "additionalProperties": False}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "A city's weather",
                                      "parameters": CITY}},
    {"type": "function", "function": {"name": "get_time", "description": "The time now"}},
]  # fmt: skip
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MC = [  # lm-eval multiple choice rows: context, choices (the " " delimiter goes before each)
    {"question": "The capital of France is", "choices": ["Paris", "London", "Rome"], "answer": 0},
    {"question": "Two plus two equals", "choices": ["four", "seven"], "answer": 0},
]


def _loglikelihoods(llm):
    """LLM's prompt log-probs of each choice's tokens, tokenized as lm-eval does (context and
    context + " " + choice without special tokens; the choice is what follows the context)."""
    tok, out = llm.tokenizer, []
    for row in MC:
        n_ctx = len(tok(row["question"], add_special_tokens=False)["input_ids"])
        for choice in row["choices"]:
            ids = tok(row["question"] + " " + choice, add_special_tokens=False)["input_ids"]
            sp = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
            lps = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0].prompt_logprobs
            lps = [None] * (len(ids) - len(lps)) + lps  # entry p scores token p
            out.append(sum(lps[p][ids[p]].logprob for p in range(n_ctx, len(ids))))
    return out


@pytest.fixture(scope="module")
def smol():
    """(server, the offline outputs computed before the engine thread owns the engine, llm)."""
    from jaxserve import LLM
    from jaxserve.entrypoints.async_llm import AsyncLLM
    from jaxserve.entrypoints.openai.server import build_app

    llm = LLM(**KW)
    sp = SamplingParams(temperature=0, max_tokens=N)
    offline = {
        "text": llm.generate([PROMPT], sp, use_tqdm=False)[0],
        "chat": llm.chat(CHAT, sp, use_tqdm=False)[0],
        "chat_lp": llm.chat(
            CHAT, SamplingParams(temperature=0, max_tokens=4, logprobs=2), use_tqdm=False
        )[0],
    }
    continued = dict(add_generation_prompt=False, continue_final_message=True)
    # vLLM's LLM.chat: a list of conversations in one call, each rendered with the same options
    offline["continued"] = llm.chat([PARTIAL, PARTIAL[:1]], sp, use_tqdm=False, **continued)
    offline["mc"] = _loglikelihoods(llm)
    four = SamplingParams(temperature=0, max_tokens=4)
    offline["parts"] = llm.chat(
        [
            [{"role": "user", "content": "Name three\ncolors."}],
            [{"role": "user", "content": PARTS}],
        ],
        four,
        use_tqdm=False,
    )
    so = SamplingParams(temperature=0, max_tokens=64, structured_outputs={"json": SCHEMA})
    offline["json"] = llm.chat(JSON_CHAT, so, use_tqdm=False)[0]
    for key, choice in (("named", NAMED), ("required", "required")):  # the tool calls' grammars
        schema = ToolUse.of(TOOLS, choice, parallel_tool_calls=False).schema
        sp = SamplingParams(temperature=0, max_tokens=48, structured_outputs={"json": schema})
        offline[key] = llm.chat(WEATHER_CHAT, sp, use_tqdm=False, tools=TOOLS)[0]
    allm = AsyncLLM.from_llm(llm)
    server = ServerThread(build_app(allm, "smollm2"))
    yield server, offline, llm
    server.stop()
    allm.shutdown()


@pytest.fixture(scope="module")
def client(smol):
    return openai.OpenAI(base_url=smol[0].url, api_key="none", max_retries=0)


def test_text_completion_equals_llm(smol, client):
    ref = smol[1]["text"].outputs[0]
    r = client.completions.create(model="smollm2", prompt=PROMPT, temperature=0, max_tokens=N)
    assert r.choices[0].text == ref.text
    assert r.choices[0].token_ids == ref.token_ids
    stream = client.completions.create(
        model="smollm2", prompt=PROMPT, temperature=0, max_tokens=N, stream=True
    )
    assert "".join(ch.text for c in stream for ch in c.choices) == ref.text
    r = client.completions.create(
        model="smollm2", prompt=PROMPT, temperature=0, max_tokens=N, echo=True
    )
    assert r.choices[0].text == PROMPT + ref.text


def test_chat_equals_llm_chat(smol, client):
    ref = smol[1]["chat"].outputs[0]
    r = client.chat.completions.create(model="smollm2", messages=CHAT, temperature=0, max_tokens=N)
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == len(ref.token_ids)

    async def stream():
        async with openai.AsyncOpenAI(base_url=smol[0].url, api_key="none") as ac:
            s = await ac.chat.completions.create(
                model="smollm2", messages=CHAT, temperature=0, max_completion_tokens=N,
                stream=True,
            )  # fmt: skip
            chunks = [c async for c in s]
        assert chunks[0].choices[0].delta.role == "assistant"
        return "".join(c.choices[0].delta.content or "" for c in chunks)

    assert asyncio.run(stream()) == ref.text


def test_content_parts_as_vllm_and_an_image_is_a_400(smol, client):
    """A list of text parts is the newline-joined string (vLLM's "string" content format), in
    LLM.chat and served alike; an image part to this text-only model is a 400 naming it."""
    ref, via_parts = smol[1]["parts"]
    assert via_parts.prompt_token_ids == ref.prompt_token_ids
    r = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": PARTS}], temperature=0, max_tokens=4
    )
    assert r.choices[0].message.content == ref.outputs[0].text
    image = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": [PARTS[0], image]}], max_tokens=4
        )
    assert e.value.body["param"] == "messages"
    assert "messages[0].content[1] is of type 'image_url'" in e.value.body["message"]


def test_continue_final_message_offline_and_served(smol, client):
    """The partial assistant message is continued, not answered anew: the same tokens as a plain
    generate from its rendered text, offline and through the server (vLLM's extra_body field)."""
    cont, plain = smol[1]["continued"]
    llm = smol[2]
    assert cont.prompt.endswith("The three colors are") and cont.outputs[0].text
    assert plain.prompt.endswith("Name three colors.")  # continues the user's message
    r = client.chat.completions.create(
        model="smollm2",
        messages=PARTIAL,
        temperature=0,
        max_tokens=N,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert r.choices[0].message.content == cont.outputs[0].text
    assert r.usage.prompt_tokens == len(cont.prompt_token_ids)
    assert (
        cont.prompt_token_ids == llm.tokenizer(cont.prompt, add_special_tokens=False)["input_ids"]
    )
    with pytest.raises(openai.BadRequestError, match="cannot both be true"):
        client.chat.completions.create(
            model="smollm2", messages=PARTIAL, max_tokens=2,
            extra_body={"continue_final_message": True},
        )  # fmt: skip


def test_chat_logprobs(smol, client):
    ref = smol[1]["chat_lp"].outputs[0]
    r = client.chat.completions.create(
        model="smollm2", messages=CHAT, temperature=0, max_tokens=4, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    assert [c.logprob for c in content] == pytest.approx(
        [e[t].logprob for t, e in zip(ref.token_ids, ref.logprobs)], abs=1e-5
    )
    assert all(len(c.top_logprobs) == 2 for c in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob
    # vLLM's prompt_logprobs extra: the response's, one entry per prompt token (the first None),
    # each token's decoded text beside it; the answer is unchanged
    r2 = client.chat.completions.create(
        model="smollm2", messages=CHAT, temperature=0, max_tokens=4,
        extra_body={"prompt_logprobs": 1},
    )  # fmt: skip
    plps = r2.model_extra["prompt_logprobs"]
    ids = smol[1]["chat"].prompt_token_ids
    assert plps[0] is None and len(plps) == len(ids) == r2.usage.prompt_tokens
    for t, entry in zip(ids[1:], plps[1:]):
        assert entry[str(t)]["decoded_token"] == smol[2].tokenizer.decode([t])
        assert 1 <= len(entry) <= 2 and all(v["logprob"] <= 0 for v in entry.values())
    assert r2.choices[0].message.content == r.choices[0].message.content


def test_chat_echo_documents_and_a_request_template(smol, client):
    """vLLM's chat extras: `echo` puts the final assistant message before the reply (streamed as
    its own delta); a request's own chat template (or one in chat_template_kwargs) is a 400
    unless the server trusts them; then it renders, `documents` reaching it."""
    from jaxserve.entrypoints.openai.server import build_app

    server, offline, llm = smol
    ref = offline["continued"][0].outputs[0]
    kw = dict(model="smollm2", messages=PARTIAL, temperature=0, max_tokens=N,
              extra_body={"continue_final_message": True, "add_generation_prompt": False,
                          "echo": True})  # fmt: skip
    r = client.chat.completions.create(**kw)
    assert r.choices[0].message.content == PARTIAL[-1]["content"] + ref.text
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks)
        == PARTIAL[-1]["content"] + ref.text
    )
    plain = client.chat.completions.create(**{**kw, "messages": CHAT, "extra_body": {"echo": True}})
    assert plain.choices[0].message.content == offline["chat"].outputs[0].text  # user turn last

    template = "{% for d in documents %}[{{ d.text }}]{% endfor %}{{ messages[0].content }} ="
    bodies = [{"extra_body": {"chat_template": template}},
              {"extra_body": {"chat_template_kwargs": {"chat_template": template}}}]  # fmt: skip
    for extra in bodies:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=1, **extra)
        assert e.value.body["param"] == "chat_template"
    allm = server.server.config.app.state.serving.async_llm
    trusted = ServerThread(build_app(allm, "smollm2", trust_request_chat_template=True))
    try:
        c2 = openai.OpenAI(base_url=trusted.url, api_key="none", max_retries=0)
        docs = [{"text": "Colors are hues."}]
        r = c2.chat.completions.create(
            model="smollm2", messages=CHAT, max_tokens=1,
            extra_body={"chat_template": template, "documents": docs},
        )  # fmt: skip
        want = llm.tokenizer("[Colors are hues.]Name three colors. =", add_special_tokens=False)
        assert r.usage.prompt_tokens == len(want["input_ids"])
    finally:
        trusted.stop()


def test_chat_truncate_prompt_tokens(client):
    """vLLM's truncate_prompt_tokens on a chat: the rendered conversation's last k tokens."""
    r = client.chat.completions.create(
        model="smollm2", messages=CHAT, max_tokens=2, extra_body={"truncate_prompt_tokens": 5}
    )
    assert r.usage.prompt_tokens == 5 and r.choices[0].message.content


def test_stop_string(smol, client):
    ref = smol[1]["text"].outputs[0].text
    stop = ref.strip().split()[1]
    r = client.completions.create(
        model="smollm2", prompt=PROMPT, temperature=0, max_tokens=N, stop=[stop]
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == ref[: ref.index(stop)]


def test_tokenize_detokenize(smol):
    base, llm = smol[0].base, smol[2]
    r = httpx.post(f"{base}/tokenize", json={"prompt": PROMPT}).json()
    assert r["tokens"] == llm.tokenizer(PROMPT)["input_ids"] and r["count"] == len(r["tokens"])
    back = httpx.post(f"{base}/detokenize", json={"tokens": r["tokens"]}).json()
    assert back["prompt"] == llm.tokenizer.decode(r["tokens"])
    chat = httpx.post(f"{base}/tokenize", json={"messages": CHAT}).json()
    assert chat["tokens"] == smol[1]["chat"].prompt_token_ids


@pytest.mark.slow
def test_lm_eval_local_completions(smol, tmp_path, monkeypatch):
    """lm-evaluation-harness's `local-completions` client scores a local multiple-choice task
    (YAML over a JSONL written here) end to end; its loglikelihoods equal LLM's prompt log-probs."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    server, offline, llm = smol
    write_multiple_choice_task(tmp_path, "tiny_mc", MC)
    tok_dir = tmp_path / "tokenizer"
    llm.tokenizer.save_pretrained(tok_dir)
    results, got = score_with_local_completions(
        server.url, "smollm2", tmp_path, "tiny_mc", tok_dir,
        ",max_length=256,num_concurrent=2,max_retries=1",
    )  # fmt: skip
    assert got == pytest.approx(offline["mc"], abs=1e-4)
    assert 0.0 <= results["results"]["tiny_mc"]["acc,none"] <= 1.0


@pytest.mark.slow
def test_lm_eval_local_chat_completions(smol, tmp_path, monkeypatch):
    """lm-eval's `local-chat-completions` client runs a generate_until task end to end; its
    answers equal LLM.chat's greedy text (cut at the task's stop string)."""
    import json

    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    server, offline, _ = smol
    data = tmp_path / "gen.jsonl"
    data.write_text(json.dumps({"question": CHAT[0]["content"], "answer": "red"}) + "\n")
    (tmp_path / "tiny_gen.yaml").write_text(
        "task: tiny_gen\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: generate_until\n"
        'doc_to_text: "{{question}}"\ndoc_to_target: "{{answer}}"\n'
        f"generation_kwargs:\n  until: []\n  max_gen_toks: {N}\n  temperature: 0\n"
        "metric_list:\n  - metric: exact_match\n"
    )
    results = lm_eval.simple_evaluate(
        model="local-chat-completions",
        model_args=f"model=smollm2,base_url={server.url}/chat/completions,tokenizer_backend=none",
        tasks=["tiny_gen"],
        task_manager=TaskManager(include_path=str(tmp_path)),
        apply_chat_template=True,
        log_samples=True,
    )
    sample = results["samples"]["tiny_gen"][0]
    assert sample["resps"][0][0] == offline["chat"].outputs[0].text


def test_structured_outputs_served_as_offline(smol, client):
    """OpenAI's response_format (json_schema, json_object) and vLLM's structured_outputs extra:
    the served JSON equals LLM.chat's with the same constraint and validates; a stream joins to
    it; a choice is one of its choices; bad constraints (and too many top_logprobs) are 400s
    naming the field, streamed or not."""
    import json

    import jsonschema

    ref = smol[1]["json"].outputs[0]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    kw = dict(model="smollm2", messages=JSON_CHAT, temperature=0, max_tokens=64)
    r = client.chat.completions.create(response_format=fmt, **kw)
    assert r.choices[0].message.content == ref.text
    jsonschema.validate(json.loads(ref.text), SCHEMA)
    stream = client.chat.completions.create(response_format=fmt, stream=True, **kw)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == ref.text
    yes_no = [
        {"role": "user", "content": 'Is the sky blue? Answer as JSON like {"answer": "yes"}.'}
    ]
    r = client.chat.completions.create(
        response_format={"type": "json_object"}, **{**kw, "messages": yes_no}
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(
        model="smollm2",
        prompt="The best fruit is",
        max_tokens=8,
        extra_body={"structured_outputs": {"choice": ["apple", "pear"]}},
    )
    assert r.choices[0].text in ("apple", "pear")
    bad = [
        ({"extra_body": {"structured_outputs": {"regex": "[a-"}}}, "structured_outputs"),
        ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}}, "structured_outputs"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"structured_outputs": {"regex": "a"}}}, "structured_outputs"),
        ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),  # over max_logprobs (20)
    ]  # fmt: skip
    for (extra, param), stream in itertools.product(bad, (False, True)):
        with pytest.raises(openai.BadRequestError) as e:  # streamed too: a 400, not an event
            client.chat.completions.create(**kw, **extra, stream=stream)
        assert e.value.body["param"] == param, e.value.body


def test_responses_api_as_chat(smol, client):
    """POST /v1/responses through the openai client's `responses.create`: the text equals
    LLM.chat's (input a string), or the served chat's with `instructions` as a system message
    (input a list with text parts); streamed, OpenAI's events in order whose deltas join into
    the text; text.format is a structured output; what is not served is a 400 naming it."""
    import pydantic

    ref = smol[1]["chat"]
    kw = dict(model="smollm2", temperature=0, max_output_tokens=N)
    r = client.responses.create(input=CHAT[0]["content"], **kw)
    out = ref.outputs[0]
    assert (
        r.output_text == out.text and r.id.startswith("resp_") and r.output[0].role == "assistant"
    )
    assert r.usage.output_tokens == len(out.token_ids)
    assert r.usage.input_tokens == len(ref.prompt_token_ids) and r.store is False
    if out.finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed" and r.incomplete_details is None

    system = [{"role": "system", "content": "Answer in one word."},
              {"role": "user", "content": "Name a color."}]  # fmt: skip
    chat = client.chat.completions.create(
        model="smollm2", messages=system, temperature=0, max_tokens=8
    )
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Name a color."}]}]
    r2 = client.responses.create(
        model="smollm2", instructions="Answer in one word.", input=items, temperature=0,
        max_output_tokens=8, metadata={"run": "7"},
    )  # fmt: skip
    assert r2.output_text == chat.choices[0].message.content
    no_tools = client.responses.create(  # no tools, as an empty list: plain text
        model="smollm2", instructions="Answer in one word.", input=items, temperature=0,
        max_output_tokens=8, tools=[], tool_choice="auto",
    )  # fmt: skip
    assert no_tools.output_text == chat.choices[0].message.content
    assert r2.instructions == "Answer in one word." and r2.metadata == {"run": "7"}

    events = list(client.responses.create(input=CHAT[0]["content"], stream=True, **kw))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]  # fmt: skip
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{r.status}"]  # fmt: skip
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events[4:-4]) == out.text == events[-4].text
    assert events[-1].response.output_text == out.text

    async def streamed_async():
        aclient = openai.AsyncOpenAI(base_url=smol[0].url, api_key="none", max_retries=0)
        stream = await aclient.responses.create(input=CHAT[0]["content"], stream=True, **kw)
        return "".join([e.delta async for e in stream if e.type == "response.output_text.delta"])

    assert asyncio.run(streamed_async()) == out.text

    fmt = {"format": {"type": "json_schema", "name": "person", "schema": SCHEMA, "strict": True}}
    r3 = client.responses.create(
        model="smollm2", input=JSON_CHAT[0]["content"], text=fmt, temperature=0,
        max_output_tokens=64,
    )  # fmt: skip
    assert r3.output_text == smol[1]["json"].outputs[0].text

    # the client's helpers: a pydantic text_format parsed, the stream helper's final response
    class Person(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        name: str = pydantic.Field(max_length=16)
        age: int

    parsed = client.responses.parse(
        model="smollm2", input=JSON_CHAT[0]["content"], text_format=Person, temperature=0,
        max_output_tokens=64,
    ).output_parsed  # fmt: skip
    assert isinstance(parsed, Person)
    with client.responses.stream(input=CHAT[0]["content"], **kw) as s:
        assert s.get_final_response().output_text == out.text

    bad = [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tool_choice"),  # auto
        ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]},
         "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input"),
        ({"input": []}, "input"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input"),
        ({"max_output_tokens": 10**6}, "max_output_tokens"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
        ({"background": True}, "background"),
    ]  # fmt: skip
    for extra, param in bad:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as e:
                client.responses.create(**{"input": "hi", **kw, **extra}, stream=stream)
            assert e.value.body["param"] == param, (extra, e.value.body)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(**{**kw, "model": "other"}, input="hi")


def test_responses_clients_that_leave_free_their_slots(smol):
    """Four /v1/responses streams at once (the slots): the two that leave after two text deltas
    and a non-streamed request whose client times out are aborted; the two that stay get
    LLM.chat's text; afterwards no slot or page is held."""
    import json

    server, offline, _ = smol
    url = f"{server.url}/responses"
    body = {"model": "smollm2", "input": CHAT[0]["content"], "temperature": 0, "stream": True}

    async def one(http, i):
        extra = (
            {"max_output_tokens": N} if i % 2 else {"max_output_tokens": 220, "ignore_eos": True}
        )
        deltas = []
        async with http.stream("POST", url, json={**body, **extra}) as r:
            async for line in r.aiter_lines():
                event = json.loads(line[6:]) if line.startswith("data: {") else {}
                if event.get("type") == "response.output_text.delta":
                    deltas.append(event["delta"])
                    if i % 2 == 0 and len(deltas) == 2:
                        return None  # leaves: the connection closes mid-stream
        return "".join(deltas)

    async def main():
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*[one(http, i) for i in range(4)])

    got = asyncio.run(main())
    assert got[1] == got[3] == offline["chat"].outputs[0].text
    with pytest.raises(httpx.TimeoutException):
        long = {**body, "stream": False, "max_output_tokens": 220, "ignore_eos": True}
        httpx.post(url, json=long, timeout=0.5)
    # within 2 s: unaborted, the three 220-token requests would run for seconds more
    wait_idle(server.server.config.app.state.serving.async_llm.engine, timeout=2.0)


RESPONSE_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses form


def test_responses_api_tools_as_chat(smol, client):
    """Function tools on /v1/responses as chat completions serve them: a named function's
    arguments and "required"'s calls equal LLM.chat's under the same grammars, as function_call
    items, streamed as argument deltas; "auto" with a parser gives the words, then the call; a
    function_call and its function_call_output as input render as chat's tool-call history."""
    import json

    server, offline, _ = smol
    kw = dict(model="smollm2", input=WEATHER_CHAT[0]["content"], tools=RESPONSE_TOOLS,
              temperature=0, max_output_tokens=48, parallel_tool_calls=False)  # fmt: skip
    named = {"type": "function", "name": "get_weather"}
    ref = offline["named"].outputs[0]
    r = client.responses.create(tool_choice=named, **kw)
    assert [(o.type, o.name, o.arguments) for o in r.output] == [
        ("function_call", "get_weather", ref.text)
    ]
    assert r.status == "completed" and r.output[0].call_id and r.output_text == ""
    events = list(client.responses.create(tool_choice=named, stream=True, **kw))
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == ref.text and len(deltas) > 1  # the arguments as they come
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [(a.type, a.name) for a in added] == [("function_call", "get_weather")]
    assert events[-1].type == "response.completed"
    assert events[-1].response.output[0].arguments == ref.text
    assert events[-1].response.output[0].call_id == added[0].call_id

    want = [
        (it["name"], it["parameters"]) for it in json.loads(offline["required"].outputs[0].text)
    ]
    r = client.responses.create(tool_choice="required", **kw)
    assert [(o.name, json.loads(o.arguments)) for o in r.output] == want

    # "auto" on a server with the hermes parser (the call forced by a regex, as in chat's test)
    from jaxserve.entrypoints.openai.server import build_app

    allm = server.server.config.app.state.serving.async_llm
    hermes = ServerThread(
        build_app(allm, "smollm2", tool_call_parser="hermes", enable_auto_tool_choice=True)
    )
    try:
        c2 = openai.OpenAI(base_url=hermes.url, api_key="none", max_retries=0)
        call = (r'I will check\. <tool_call>\{"name": "get_weather", "arguments": '
                r'\{"city": "[A-Z][a-z]{1,8}"\}\}</tool_call>')  # fmt: skip
        extra = {"extra_body": {"structured_outputs": {"regex": call}}}
        r = c2.responses.create(**kw, **extra)
        assert [o.type for o in r.output] == ["message", "function_call"]
        assert r.output_text == "I will check. " and r.output[1].name == "get_weather"
        events = list(c2.responses.create(stream=True, **kw, **extra))
        done = [e.item for e in events if e.type == "response.output_item.done"]
        assert [(d.type, d.status) for d in done] == [("message", "completed"),
                                                      ("function_call", "completed")]  # fmt: skip
        assert done[0].content[0].text == "I will check. "
        assert json.loads(done[1].arguments) == json.loads(r.output[1].arguments)
    finally:
        hermes.stop()

    # a call and its result as history: the template sees chat's tool-call turns
    args = '{"city": "Paris"}'
    history = [
        {"role": "user", "content": WEATHER_CHAT[0]["content"]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": args},
        {"type": "function_call_output", "call_id": "call_1", "output": "21 C and sunny"},
    ]
    chat_history = WEATHER_CHAT + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C and sunny"},
    ]  # fmt: skip
    chat = client.chat.completions.create(
        model="smollm2", messages=chat_history, tools=TOOLS, tool_choice="none", temperature=0,
        max_tokens=16,
    )  # fmt: skip
    r = client.responses.create(
        **{**kw, "input": history, "max_output_tokens": 16}, tool_choice="none"
    )
    assert r.output_text == chat.choices[0].message.content


def test_tool_calls_served_as_offline(smol, client):
    """tool_choice as vLLM serves it: a named function's arguments are LLM.chat's output under
    that function's schema; "required" gives the calls of LLM.chat's output under vLLM's array
    schema; streamed, the deltas join into the same calls. "auto" (also what tools without
    tool_choice mean) is a 400 unless the server has a tool-call parser; with each parser
    (hermes, llama3_json, pythonic, mistral), the calls are parsed out of the text, streamed or
    not. Bad tools and tool_choice values are 400s naming the field."""
    import json

    import jsonschema
    import pydantic

    server, offline, _ = smol
    kw = dict(model="smollm2", messages=WEATHER_CHAT, tools=TOOLS, temperature=0, max_tokens=48)

    def streamed(**extra):
        chunks = list(client.chat.completions.create(stream=True, **kw, **extra))
        calls, content = {}, ""
        for ch in chunks:
            for c in ch.choices:
                content += c.delta.content or ""
                for d in c.delta.tool_calls or []:
                    call = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                    call["name"] += (d.function and d.function.name) or ""
                    call["arguments"] += (d.function and d.function.arguments) or ""
        finish = [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason]
        return content, [calls[i] for i in sorted(calls)], finish

    ref = offline["named"].outputs[0]
    r = client.chat.completions.create(tool_choice=NAMED, parallel_tool_calls=False, **kw)
    msg = r.choices[0].message
    assert msg.content == "" and len(msg.tool_calls) == 1
    assert msg.tool_calls[0].function.name == "get_weather"
    assert msg.tool_calls[0].function.arguments == ref.text
    jsonschema.validate(json.loads(ref.text), CITY)
    assert r.choices[0].finish_reason == ref.finish_reason == "stop"  # named: the output's own
    content, calls, finish = streamed(tool_choice=NAMED, parallel_tool_calls=False)
    assert content == "" and finish == ["stop"]
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", ref.text)]
    assert calls[0]["id"].startswith("chatcmpl-tool-")

    ref = offline["required"].outputs[0]
    want = [(it["name"], it["parameters"]) for it in json.loads(ref.text)]
    assert len(want) == 1 and ref.finish_reason == "stop"
    r = client.chat.completions.create(tool_choice="required", parallel_tool_calls=False, **kw)
    got = [
        (c.function.name, json.loads(c.function.arguments)) for c in r.choices[0].message.tool_calls
    ]
    assert got == want and r.choices[0].finish_reason == "tool_calls"
    content, calls, finish = streamed(tool_choice="required", parallel_tool_calls=False)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == want
    assert finish == ["tool_calls"]

    # the client's own helpers: a pydantic tool (strict), parsed arguments, the stream helper
    # (which merges tool-call deltas), then the call and its result as history for a next turn
    class GetWeather(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=12)

    helper_kw = {**kw, "tools": [openai.pydantic_function_tool(GetWeather)]}
    forced = {"type": "function", "function": {"name": "GetWeather"}}
    r = client.chat.completions.parse(tool_choice=forced, **helper_kw)
    parsed = r.choices[0].message.tool_calls[0].function.parsed_arguments
    assert isinstance(parsed, GetWeather)
    with client.chat.completions.stream(tool_choice=forced, **helper_kw) as s:
        final = s.get_final_completion()
    assert final.choices[0].message.tool_calls[0].function.parsed_arguments == parsed
    call = r.choices[0].message.tool_calls[0]
    history = WEATHER_CHAT + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude={"function": {"parsed_arguments"}})]},
        {"role": "tool", "tool_call_id": call.id, "content": "21 C and sunny"},
    ]  # fmt: skip
    r = client.chat.completions.create(tool_choice="none", **{**helper_kw, "messages": history})
    assert r.choices[0].message.content

    r = client.chat.completions.create(tool_choice="none", **kw)  # the template sees the tools
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason in ("stop", "length")

    bad = [
        ({}, "tool_choice"),  # tools without tool_choice: "auto", which needs a parser
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": NAMED, "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tool_choice": "required", "tools": []}, "tools"),
        ({"tool_choice": "none", "tools": [{"type": "function"}]}, "tools"),
    ]
    for (extra, param), stream in itertools.product(bad, (False, True)):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**{**kw, **extra}, stream=stream)
        assert e.value.body["param"] == param, (extra, e.value.body)

    # servers with each tool-call parser: "auto" reads the calls out of the text (forced here
    # with a regex, as SmolLM2 was not trained to call tools); the content is what precedes them
    from jaxserve.entrypoints.openai.server import build_app

    allm = server.server.config.app.state.serving.async_llm
    city = r'\{"city": "[A-Z][a-z]{1,8}"\}'
    forced = {
        "hermes": (rf'I will check\. <tool_call>\{{"name": "get_weather", "arguments": {city}\}}</tool_call>', "I will check. "),
        "llama3_json": (rf'\{{"name": "get_weather", "parameters": {city}\}}', None),
        "pythonic": (r'\[get_weather\(city="[A-Z][a-z]{1,8}"\)\]', None),
        "mistral": (rf'I will check\.\[TOOL_CALLS\]\[\{{"name": "get_weather", "arguments": {city}\}}\]', "I will check."),
    }  # fmt: skip
    for parser, (call, want_content) in forced.items():
        parsing = ServerThread(
            build_app(allm, "smollm2", tool_call_parser=parser, enable_auto_tool_choice=True)
        )
        try:
            c2 = openai.OpenAI(base_url=parsing.url, api_key="none", max_retries=0)
            extra = {"extra_body": {"structured_outputs": {"regex": call}}}
            r = c2.chat.completions.create(**kw, **extra)
            msg = r.choices[0].message
            assert msg.content == want_content and r.choices[0].finish_reason == "tool_calls"
            assert [c.function.name for c in msg.tool_calls] == ["get_weather"], parser
            args = json.loads(msg.tool_calls[0].function.arguments)
            jsonschema.validate(args, CITY)
            chunks = list(c2.chat.completions.create(stream=True, **kw, **extra))
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
            assert content == (msg.content or ""), parser
            assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == [
                ("get_weather", args)
            ]
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
        finally:
            parsing.stop()


HOSTILE = [-1, 2**63, 1e308, 0.5, True, "x" * 4096, [None], [[1, 2], "x"], {"7": 1e9}, {"x": 1},
           [-1], [2**40], {"type": "json_schema"}]  # fmt: skip
# null and empty values where they are not the default (elsewhere they are a plain request)
EMPTY = {"prompt": [None, "", [], [[]]], "messages": [None, [], {}], "n": [None],
         "stream": [None], "echo": [None], "presence_penalty": [None], "logit_bias": [{}, []]}  # fmt: skip
FIELDS = ("max_tokens", "temperature", "top_p", "n", "stop", "seed", "presence_penalty",
          "frequency_penalty", "stream", "stream_options", "logit_bias", "top_k", "min_p",
          "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "allowed_token_ids",
          "bad_words", "response_format", "structured_outputs", "model", "user",
          "truncate_prompt_tokens", "use_beam_search")  # fmt: skip
CHAT_FIELDS = ("messages", "logprobs", "top_logprobs", "max_completion_tokens", "tools", "n",
               "stream", "chat_template_kwargs", "continue_final_message",
               "add_generation_prompt", "tool_choice", "parallel_tool_calls", "echo",
               "documents", "chat_template")  # fmt: skip
ROUTES = {  # the shared sampling fields go through one parser and one check: tested once
    "/v1/completions": (
        {"prompt": PROMPT},
        FIELDS + ("prompt", "logprobs", "echo", "suffix", "add_special_tokens"),
    ),
    "/v1/chat/completions": ({"messages": CHAT}, CHAT_FIELDS),
    "/v1/responses": (
        {"input": CHAT[0]["content"], "max_output_tokens": 2},
        (
            "input",
            "instructions",
            "max_output_tokens",
            "text",
            "metadata",
            "store",
            "previous_response_id",
            "conversation",
            "background",
            "tools",
            "tool_choice",
            "parallel_tool_calls",
            "include",
            "top_logprobs",
            "truncation",
            "reasoning",
            "stream",
            "temperature",
            "top_p",
            "n",
            "stop",
            "seed",
            "structured_outputs",
        ),
    ),  # fmt: skip
}
RAW = [b"", b"null", b"[]", b'"x"', b"{", b"\xff\xfe", b"[" * 100_000,
       b'{"prompt": "x", "max_tokens": NaN}', b'{"prompt": "x", "temperature": Infinity}']  # fmt: skip
BAD_PARAMETERS = [{"type": "foo"}, {"type": "object", "$defs": 5}, [1, 2], "x",
                  {"type": "object", "properties": {"a": {"$ref": "#/$defs/X"}}}]  # fmt: skip
MESSAGES = [[{"role": "user"}], [{"role": "user", "content": [{"type": "text"}]}],
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            [{"role": 5, "content": "x"}], [{"content": "x"}], ["x"], [None]]  # fmt: skip


def test_hostile_values_in_every_field_get_a_4xx_or_an_answer_and_harm_nobody(smol):
    """Each field, set in turn to a hostile value (wrong type, out of range,
    huge, empty, nested), plus malformed bodies and message shapes: every answer is a 2xx or a
    4xx carrying OpenAI's error object, never a 5xx; afterwards the server is healthy, holds no
    request, and a plain request still gives LLM's tokens."""
    server, offline, _ = smol
    bodies = []
    for route, (base, fields) in ROUTES.items():
        base = {"model": "smollm2", "max_tokens": 2, "max_completion_tokens": 2, **base}
        if route != "/v1/chat/completions":
            base.pop("max_completion_tokens")
        for field in fields:
            for value in HOSTILE + EMPTY.get(field, []):
                bodies.append((route, {**base, field: value}))
        bodies += [(route, raw) for raw in RAW]
    chat = {"model": "smollm2", "max_tokens": 2}
    bodies += [("/v1/chat/completions", {**chat, "messages": m}) for m in MESSAGES]
    for params, choice in itertools.product(BAD_PARAMETERS, (NAMED, "required")):
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}}]
        body = {**chat, "messages": CHAT, "tools": tools, "tool_choice": choice}
        bodies += [
            ("/v1/chat/completions", body),
            ("/v1/chat/completions", {**body, "stream": True}),
        ]

    def failure(http, route, body):
        if isinstance(body, bytes):
            r = http.post(route, content=body, headers={"content-type": "application/json"})
        else:
            r = http.post(route, json=body)
        if 200 <= r.status_code < 300 and route == "/v1/responses":
            streamed = body.get("stream") is True
            ok = "event: response.completed" in r.text or "event: response.incomplete" in r.text
            ok = ok if streamed else r.json()["status"] in ("completed", "incomplete")
        elif 200 <= r.status_code < 300:
            ok = "data: [DONE]" in r.text if body.get("stream") is True else "choices" in r.json()
        else:
            err = r.json().get("error", {}) if 400 <= r.status_code < 500 else {}
            ok = set(err) == {"message", "type", "param", "code"} and bool(err["message"])
        return None if ok else (route, str(body)[:120], r.status_code, r.text[:200])

    with httpx.Client(base_url=server.base, timeout=120) as http:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:  # 4 clients at once, as the slots
            failures = [f for f in pool.map(lambda rb: failure(http, *rb), bodies) if f]
        assert not failures, failures
        assert http.get("/health").status_code == 200
    wait_idle(server.server.config.app.state.serving.async_llm.engine)  # no slot or page held
    r = httpx.post(
        f"{server.url}/completions", json={"prompt": PROMPT, "temperature": 0, "max_tokens": N}
    )
    assert r.json()["choices"][0]["token_ids"] == offline["text"].outputs[0].token_ids
