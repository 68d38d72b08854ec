"""Adapters saved by Hugging Face PEFT itself (tests/golden/make_lora_goldens.py: its tensor names
and config, random A and B), through the engine: every prompt position's log-probs equal PEFT's
adapted model's to 1e-4 (f32), for Llama (all seven projections; rsLoRA on three of them in one
layer) and Phi-3's fused qkv_proj / gate_up_proj. The adapters change those log-probs well beyond
the tolerance (checked against the base golden)."""

from __future__ import annotations

import numpy as np
import pytest
from model_testing import GOLDEN_DIR

from jaxserve import LLM, SamplingParams
from jaxserve.lora import LoRARequest

CASES = {"llama_r4": "llama", "llama_rs8": "llama", "phi3_fused": "phi3"}


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_engine_equals_hf_peft(case):
    base, folder = GOLDEN_DIR / CASES[case], GOLDEN_DIR / "lora" / case
    golden = np.load(folder / "logits.npz")
    tokens, want = golden["tokens"], log_softmax(golden["logits"])  # [B, T], [B, T, V]
    unadapted = log_softmax(np.load(base / "logits.npz")["logits"])
    assert np.abs(want - unadapted).max() > 1e-2  # the adapter matters
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=8, num_slots=2,
              max_model_len=64, page_size=8)  # fmt: skip
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1, logprobs=1)
    outs = llm.generate(
        [{"prompt_token_ids": row.tolist()} for row in tokens],
        sp,
        use_tqdm=False,
        lora_request=LoRARequest(case, 1, str(folder)),
    )
    for b, out in enumerate(outs):
        assert out.error is None, out.error
        for t in range(1, tokens.shape[1]):  # the log-prob of each prompt token given its prefix
            tok = int(tokens[b, t])
            got = out.prompt_logprobs[t][tok].logprob
            assert got == pytest.approx(want[b, t - 1, tok], abs=1e-4), (b, t)
        first = out.outputs[0]  # the greedy token after the prompt: PEFT's argmax, its log-prob
        assert first.token_ids[0] == int(want[b, -1].argmax())
        got = first.logprobs[0][first.token_ids[0]].logprob
        assert got == pytest.approx(want[b, -1].max(), abs=1e-4)
