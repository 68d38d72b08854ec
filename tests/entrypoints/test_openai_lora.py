"""LoRA adapters through the server, with the real `openai` client: a request's `model` selects
the adapter (its completions equal LLM.generate with that LoRARequest, token for token), the
base model keeps its name, /v1/models lists the adapters with their folder and parent, adapters
load and unload at run time (vLLM's endpoints), and bad adapters or names are errors naming them.
The tiny golden Llama (f32), token-id prompts."""

from __future__ import annotations

import httpx
import openai
import pytest
from lora_testing import write_adapter
from model_testing import GOLDEN_DIR
from serving_testing import ServerThread

from jaxserve import LLM, SamplingParams
from jaxserve.lora import LoRARequest

BASE = GOLDEN_DIR / "llama"
KW = dict(dtype="float32", num_slots=4, max_model_len=64, page_size=8, prefill_chunk_size=16)
PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42], [100, 3, 200, 17, 18, 19, 20]]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from jaxserve.entrypoints.async_llm import AsyncLLM
    from jaxserve.entrypoints.openai.server import build_app

    root = tmp_path_factory.mktemp("lora")
    paths = {
        "sql": write_adapter(root / "sql", BASE, rank=4, seed=1),
        "chat": write_adapter(root / "chat", BASE, rank=8, seed=2, modules=("q_proj", "o_proj")),
        "late": write_adapter(root / "late", BASE, rank=2, seed=3),
        "big": write_adapter(root / "big", BASE, rank=32, seed=4),
    }
    llm = LLM(str(BASE), enable_lora=True, max_loras=2, max_lora_rank=8, **KW)
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ps = [{"prompt_token_ids": p} for p in PROMPTS]
    want = {
        name: [
            o.outputs[0].token_ids
            for o in llm.generate(
                ps, sp, use_tqdm=False, lora_request=LoRARequest(name, i + 1, str(paths[name]))
            )
        ]
        for i, name in enumerate(("sql", "chat", "late"))
    }
    want["base"] = [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]
    allm = AsyncLLM.from_llm(llm)
    app = build_app(
        allm,
        "base",
        lora_modules={"sql": str(paths["sql"]), "chat": str(paths["chat"])},
        allow_runtime_lora_updating=True,
    )
    server = ServerThread(app)
    server.app = app
    yield server, paths, want
    server.stop()
    allm.shutdown()


def completions(client, model):
    r = client.completions.create(
        model=model,
        prompt=PROMPTS,
        temperature=0,
        max_tokens=MAX_TOKENS,
        extra_body={"ignore_eos": True},
    )
    assert r.model == model
    return [c.token_ids for c in r.choices]


def test_the_model_field_selects_the_adapter(setup):
    server, paths, want = setup
    client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
    for model in ("sql", "chat", "base", "sql"):
        assert completions(client, model) == want[model]
    ids = [m.id for m in client.models.list().data]
    assert ids == ["base", "sql", "chat"]
    card = client.models.retrieve("chat")
    assert card.root == str(paths["chat"]) and card.parent == "base"
    with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist"):
        client.completions.create(model="nope", prompt=PROMPTS[0], max_tokens=1)


def test_adapters_load_and_unload_at_run_time(setup):
    server, paths, want = setup
    client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
    url = server.base
    body = {"lora_name": "late", "lora_path": str(paths["late"])}
    r = httpx.post(f"{url}/v1/load_lora_adapter", json=body)
    assert r.status_code == 200 and "added successfully" in r.text
    assert completions(client, "late") == want["late"]
    again = httpx.post(f"{url}/v1/load_lora_adapter", json=body)
    assert (
        again.status_code == 400 and "has already been loaded" in again.json()["error"]["message"]
    )
    big = httpx.post(
        f"{url}/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": str(paths["big"])}
    )
    assert big.status_code == 400
    assert "rank r=32 is above max_lora_rank=8" in big.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert r.status_code == 200 and "removed successfully" in r.text
    assert "late" not in [m.id for m in client.models.list().data]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", prompt=PROMPTS[0], max_tokens=1)
    gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert gone.status_code == 404 and "cannot be found" in gone.json()["error"]["message"]
    # three adapters over two device slots, interleaved: each still equals its own outputs
    httpx.post(f"{url}/v1/load_lora_adapter", json=body).raise_for_status()
    for model in ("late", "sql", "chat", "late", "base"):
        assert completions(client, model) == want[model]


def test_a_bad_startup_adapter_is_named(tmp_path, setup):
    from jaxserve.entrypoints.openai.server import build_app

    server, paths, _ = setup
    allm = server.app.state.serving.async_llm
    with pytest.raises(ValueError, match=r"LoRA adapter 'big' .*max_lora_rank=8"):
        build_app(allm, "base", lora_modules={"big": str(paths["big"])})
    with pytest.raises(ValueError, match=r"LoRA adapter 'x' \(.*nope\): not a directory"):
        build_app(allm, "base", lora_modules={"x": str(tmp_path / "nope")})
