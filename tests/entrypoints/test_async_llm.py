"""AsyncLLM over the fake runner (no jax): outputs equal the engine's reference, streamed
snapshots grow to the final output, an early close aborts (slot and pages freed), an engine
exception fails every in-flight request instead of hanging it, and the idle thread sleeps."""

from __future__ import annotations

import asyncio
import time

import pytest
from serving_testing import fake_engine, wait_idle

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.entrypoints.async_llm import AsyncLLM, EngineDeadError
from jaxserve.inputs.prompts import PromptError, parse_prompt
from jaxserve.testing.fake_runner import FakeRunner, reference

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture
def allm():
    a = AsyncLLM.from_engine(fake_engine())
    yield a
    a.shutdown()


async def _final(allm, prompt, sp, rid=None, stream=False):
    outs = [o async for o in allm.generate(prompt, sp, rid, stream=stream)]
    return outs


def test_generate_equals_reference_concurrently(allm):
    prompts = [[3, 4, 5], [7] * 9, [10, 11], [12, 13, 14, 15], [20]]
    sp = SamplingParams(max_tokens=6, seed=5, **GREEDY)

    async def main():
        return await asyncio.gather(*[_final(allm, {"prompt_token_ids": p}, sp) for p in prompts])

    results = asyncio.run(main())
    for p, outs in zip(prompts, results):
        assert len(outs) == 1 and outs[0].finished
        assert outs[0].outputs[0].token_ids == reference(p, 6, seed=5)
    wait_idle(allm.engine)


def test_stream_snapshots_grow_to_the_final_output(allm):
    sp = SamplingParams(max_tokens=5, seed=1, **GREEDY)
    outs = asyncio.run(_final(allm, {"prompt_token_ids": [3, 4]}, sp, stream=True))
    lens = [len(o.outputs[0].token_ids) for o in outs]
    assert lens == sorted(lens) and lens[-1] == 5 and len(outs) >= 2
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert outs[-1].outputs[0].token_ids == reference([3, 4], 5, seed=1)


def test_bad_input_is_an_error_output_and_others_are_unaffected(allm):
    async def main():
        bad = _final(allm, {"prompt_token_ids": [999]}, SamplingParams(max_tokens=3))
        ok = _final(allm, {"prompt_token_ids": [3]}, SamplingParams(max_tokens=3, **GREEDY))
        text = _final(allm, "no tokenizer here", SamplingParams())
        return await asyncio.gather(bad, ok, text)

    bad, ok, text = asyncio.run(main())
    assert bad[0].error and "vocab_size" in bad[0].error
    assert text[0].error and "tokenizer" in text[0].error
    assert ok[0].error is None and len(ok[0].outputs[0].token_ids) == 3


def test_closing_early_aborts_and_frees_slot_and_pages(allm):
    async def main():
        gen = allm.generate({"prompt_token_ids": [3, 4]}, SamplingParams(max_tokens=60, **GREEDY))
        first = await gen.__anext__()
        await gen.aclose()
        return first

    first = asyncio.run(main())
    assert not first.finished
    wait_idle(allm.engine)
    assert allm.num_unfinished == 0


def test_cancelled_task_aborts(allm):
    async def consume():
        async for _ in allm.generate({"prompt_token_ids": [5]}, SamplingParams(max_tokens=60)):
            await asyncio.sleep(0.01)

    async def main():
        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    wait_idle(allm.engine)


class _Exploding(FakeRunner):
    def dispatch(self, plan):
        if plan.decode:
            raise RuntimeError("device on fire")
        return super().dispatch(plan)


def test_engine_exception_fails_requests_instead_of_hanging():
    allm = AsyncLLM.from_engine(fake_engine(runner_cls=_Exploding))

    async def main():
        return await asyncio.wait_for(
            asyncio.gather(
                *[_final(allm, {"prompt_token_ids": [3, i]}, SamplingParams()) for i in range(3)],
                return_exceptions=True,
            ),
            timeout=10,
        )

    results = asyncio.run(main())
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert not allm.is_running
    with pytest.raises(EngineDeadError):
        asyncio.run(_final(allm, {"prompt_token_ids": [3]}, SamplingParams()))


def test_idle_thread_sleeps(allm):
    asyncio.run(_final(allm, {"prompt_token_ids": [3]}, SamplingParams(max_tokens=2)))
    steps = allm.engine.num_steps
    t0 = time.process_time()
    time.sleep(0.3)
    assert allm.engine.num_steps == steps
    assert time.process_time() - t0 < 0.1  # no busy spin in the engine thread


def test_async_llm_refuses_what_llm_refuses():
    """The parser LLM uses (`inputs.prompts.parse_prompt`): AsyncLLM, and so the server, used to
    accept unknown keys, ids given as a string and an empty text."""

    def tokenizer(text):
        return {"input_ids": [ord(c) % 50 for c in text]}

    allm = AsyncLLM.from_engine(fake_engine(), tokenizer)
    try:

        async def error_of(prompt):
            sp = SamplingParams(max_tokens=2)
            outs = [o async for o in allm.generate(prompt, sp, stream=False)]
            assert len(outs) == 1 and outs[0].finished
            return outs[0].error

        for prompt in ({"prompt": "a", "n": 2}, {"prompt_token_ids": "1 2"}, "", {}, 7):
            with pytest.raises(PromptError) as e:
                parse_prompt(prompt, tokenizer)
            assert asyncio.run(error_of(prompt)) == str(e.value), prompt
        assert asyncio.run(error_of({"prompt_token_ids": [3, 4]})) is None
    finally:
        allm.shutdown()
