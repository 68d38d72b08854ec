"""Fixtures: a tiny dummy-weight LLM, its AsyncLLM and a server over it, shared by the session
(helpers in serving_testing.py)."""

from __future__ import annotations

import pytest
from serving_testing import MAX_TOKENS, PROMPTS, TINY_KW, ServerThread


@pytest.fixture(scope="session")
def tiny_llm():
    from jaxserve import LLM

    return LLM("tiny", **TINY_KW)


@pytest.fixture(scope="session")
def offline(tiny_llm):
    """LLM.generate's outputs the server must reproduce, computed before the AsyncLLM's thread
    owns the engine: greedy, seeded n=3 samples, log-probs, prompt log-probs."""
    from jaxserve import SamplingParams

    def run(ps, **kw):
        sp = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **kw)
        return tiny_llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)

    return {
        "greedy": run(PROMPTS, temperature=0),
        "sampled": run(PROMPTS[:2], n=3, seed=7, temperature=1.0),
        "logprobs": run(PROMPTS[:2], temperature=0, logprobs=2, prompt_logprobs=2),
    }


@pytest.fixture(scope="session")
def tiny_async(tiny_llm, offline):
    from jaxserve.entrypoints.async_llm import AsyncLLM

    allm = AsyncLLM.from_llm(tiny_llm)
    yield allm
    allm.shutdown()


@pytest.fixture(scope="session")
def tiny_server(tiny_async):
    from jaxserve.entrypoints.openai.server import build_app

    server = ServerThread(build_app(tiny_async, "tiny"))
    yield server
    server.stop()
