"""SmolLM2-135M-Instruct (the default GGUF) against Hugging Face transformers' own GGUF loading, f32."""

from __future__ import annotations

import json

import numpy as np
import pytest
from model_testing import GOLDEN_DIR, forward_logits, greedy_generate

pytestmark = pytest.mark.smollm2

NEAR_TIE = 1e-3  # HF top-2 logit margin below which either token is a correct greedy choice


def test_last_position_logits_match_hf(smollm2_f32):
    data = np.load(GOLDEN_DIR / "smollm2_logits.npz")
    lm = smollm2_f32
    got = forward_logits(lm.params, lm.config, data["tokens"][None], page_size=16)[0, -1]
    want = data["logits"]
    # 30 f32 layers, logits up to 25: measured max gap 4.3e-5 (accumulation order only).
    np.testing.assert_allclose(got, want, atol=5e-4, rtol=0)
    assert got.argmax() == want.argmax()


def test_greedy_tokens_match_hf(smollm2_f32):
    golden = json.loads((GOLDEN_DIR / "smollm2_greedy.json").read_text())
    recs = golden["prompts"]
    n = golden["new_tokens"]
    tokens, _ = greedy_generate(
        smollm2_f32.params, smollm2_f32.config, [r["prompt_token_ids"] for r in recs], n
    )
    assert_greedy_matches(golden, [row.tolist() for row in tokens])


def assert_greedy_matches(golden: dict, tokens: list[list[int]]) -> None:
    """Our greedy tokens equal HF's, each prompt up to its first near-tie (where the continuations
    may legitimately diverge); at least 80% of all golden tokens are compared."""
    recs, n = golden["prompts"], golden["new_tokens"]
    compared = 0
    for row, rec in zip(tokens, recs, strict=True):
        for step, (ours, theirs, margin) in enumerate(
            zip(row, rec["token_ids"], rec["top2_margin"])
        ):
            if margin < NEAR_TIE:
                break
            assert ours == theirs, f"{rec['prompt']!r}: step {step}: {ours} != HF {theirs}"
            compared += 1
    assert compared >= 0.8 * n * len(recs)


@pytest.mark.parametrize("impl", ["auto", "ragged"])
def test_engine_greedy_tokens_match_hf(smollm2_gguf_path, impl):
    """The serving path (LLM: paged cache, chunked prefill beside decodes, the CPU default decode
    attention -- the C++ kernel -- or the XLA 'ragged' one, on-device sampling) decodes HF's
    greedy tokens for all five prompts at once."""
    from jaxserve import LLM, SamplingParams

    golden = json.loads((GOLDEN_DIR / "smollm2_greedy.json").read_text())
    recs, n = golden["prompts"], golden["new_tokens"]
    llm = LLM(
        str(smollm2_gguf_path),
        dtype="float32",
        num_slots=4,  # five prompts: one waits for a free slot
        max_model_len=128,
        prefill_chunk_size=16,  # prompts of 35-40 tokens take three chunks
        max_num_batched_tokens=32,
        attention_impl=impl,
    )
    want = {"auto": "cpu_kernel", "ragged": "ragged"}[impl]
    assert llm.engine.runner.resolved.model.attention == want
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in recs], sp, False)
    assert_greedy_matches(golden, [list(o.outputs[0].token_ids) for o in outs])
