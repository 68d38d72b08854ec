"""Multi-LoRA through LLM.generate (vLLM's API): a request with an adapter equals the model with
that adapter merged into its weights (W + scale * B @ A, merged here, in float64, by the test);
a batch mixing adapters and none equals each alone; adapters load into and are evicted from
their device slots without recompiling; a bad adapter fails its request alone."""

import numpy as np
import pytest
from lora_testing import merged_model, write_adapter
from model_testing import GOLDEN_DIR

from jaxserve import LLM, SamplingParams
from jaxserve.bench.core import CompileCounter
from jaxserve.lora import LoRARequest

BASE = GOLDEN_DIR / "llama"
KW = dict(
    dtype="float32",
    num_slots=8,
    max_model_len=64,
    page_size=8,
    prefill_chunk_size=16,
    max_num_batched_tokens=32,
)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
SHARED = list(range(20, 40))  # a prompt prefix longer than two pages: prefix-cache hits


def prompts(n=6, seed=0):
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": SHARED + rng.integers(3, 250, 3 + i).tolist()} for i in range(n)]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    a = write_adapter(root / "all", BASE, rank=8, alpha=16, seed=1)
    b = write_adapter(root / "attn", BASE, rank=4, alpha=4, seed=2, modules=("q_proj", "v_proj"))
    c = write_adapter(root / "mlp_rs", BASE, rank=2, alpha=4, seed=3, rslora=True, layers=[1],
                      modules=("gate_proj", "down_proj", "o_proj"))  # fmt: skip
    return {
        name: LoRARequest(name, i + 1, str(path))
        for i, (name, path) in enumerate((("all", a), ("attn", b), ("mlp_rs", c)))
    }


@pytest.fixture(scope="module")
def llm():
    return LLM(str(BASE), enable_lora=True, max_loras=2, max_lora_rank=8, warmup=True, **KW)


def same(outs, refs):
    for out, ref in zip(outs, refs, strict=True):
        got, want = out.outputs[0], ref.outputs[0]
        assert out.error is None and ref.error is None
        assert got.token_ids == want.token_ids
        for g, w in zip(got.logprobs, want.logprobs, strict=True):
            assert g.keys() == w.keys()
            np.testing.assert_allclose(
                [g[t].logprob for t in g], [w[t].logprob for t in w], atol=1e-5
            )


def test_each_adapter_equals_its_merged_model(llm, adapters, tmp_path):
    ps = prompts()
    base = llm.generate(ps, GREEDY, use_tqdm=False)
    for name, req in adapters.items():
        merged = LLM(str(merged_model(tmp_path / name, BASE, req.lora_path)), **KW)
        want = merged.generate(ps, GREEDY, use_tqdm=False)
        got = llm.generate(ps, GREEDY, use_tqdm=False, lora_request=req)
        same(got, want)
        assert [o.outputs[0].token_ids for o in got] != [o.outputs[0].token_ids for o in base]
    same(llm.generate(ps, GREEDY, use_tqdm=False), base)  # no adapter: the base model


def test_a_batch_mixing_three_adapters_and_none_equals_each_alone(llm, adapters):
    """Three adapters over max_loras=2 device slots: the third waits for a slot, the least
    recently used adapter no running request holds is evicted; prefix-cache pages are never
    shared across adapters (every prompt starts with the same 20 tokens)."""
    ps = prompts(8, seed=1)
    choice = [None, *adapters.values()] * 2
    alone = {}
    for req in [None, *adapters.values()]:
        alone[req] = llm.generate(ps, GREEDY, use_tqdm=False, lora_request=req)
    loads = llm.engine.loras.num_loads
    with CompileCounter() as counter:
        mixed = llm.generate(ps, GREEDY, use_tqdm=False, lora_request=choice)
    assert counter.count == 0  # adapters came and went: nothing compiled
    assert llm.engine.loras.num_loads > loads  # slots were reloaded within the batch
    for i, req in enumerate(choice):
        same([mixed[i]], [alone[req][i]])


def test_a_bad_adapter_fails_its_request_alone(llm, adapters, tmp_path):
    bad = write_adapter(tmp_path / "big", BASE, rank=16)
    ps = prompts(3)
    outs = llm.generate(
        ps,
        GREEDY,
        use_tqdm=False,
        lora_request=[LoRARequest("big", 9, str(bad)), adapters["attn"], None],
    )
    assert outs[0].outputs[0].finish_reason == "error"
    assert "LoRA adapter 'big'" in outs[0].error and "max_lora_rank=8" in outs[0].error
    same(outs[1:], [llm.generate(ps[1], GREEDY, use_tqdm=False, lora_request=adapters["attn"])[0],
                    llm.generate(ps[2], GREEDY, use_tqdm=False)[0]])  # fmt: skip


def test_lora_requests_are_checked_before_anything_runs(llm, adapters):
    with pytest.raises(ValueError, match=r"lora_request has 2 entries for 3 prompts"):
        llm.generate(prompts(3), GREEDY, lora_request=[None, adapters["all"]])
    with pytest.raises(ValueError, match=r"must be a jaxserve.lora.LoRARequest, a list"):
        llm.generate(prompts(1), GREEDY, lora_request="all")
    plain = LLM(str(BASE), **KW)
    with pytest.raises(ValueError, match=r"LoRA is not enabled \(enable_lora=True\)"):
        plain.generate(prompts(1), GREEDY, lora_request=adapters["all"])
    with pytest.raises(ValueError, match=r"enable_lora needs data_parallel_size=1"):
        LLM(str(BASE), enable_lora=True, data_parallel_size=2, **KW)


def test_speculative_decoding_with_adapters_gives_the_plain_tokens(llm, adapters):
    """n-gram speculation verifies its drafts with each row's adapter (the verify step's token
    rows carry their slot's adapter): greedy tokens equal plain decoding's, adapters mixed."""
    spec = LLM(str(BASE), enable_lora=True, max_loras=2, max_lora_rank=8, num_speculative_tokens=2,
               prompt_lookup_max=3, **{**KW, "max_num_batched_tokens": 64})  # fmt: skip
    rng = np.random.default_rng(5)
    ps = [{"prompt_token_ids": (rng.integers(3, 250, 4).tolist() * 5)[: 12 + i]} for i in range(6)]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    choice = ([None, *adapters.values()] * 2)[: len(ps)]
    want = llm.generate(ps, sp, use_tqdm=False, lora_request=choice)
    got = spec.generate(ps, sp, use_tqdm=False, lora_request=choice)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert spec.stats()["num_spec_accepted_tokens"] > 0  # the drafts were verified, some kept


def test_fused_projections_carry_each_adapter(llm, adapters, monkeypatch):
    """The GPU's weight layout (`resolve.weight_layout` 'fused': q/k/v and gate/up each one GEMM
    over a concatenated stack), forced on the CPU: each part of a fused product still gets its own
    adapter's delta, whether the adapter covers every module ('all') or some of a group
    ('attn': q and v, not k)."""
    from jaxserve import resolve

    monkeypatch.setattr(resolve, "weight_layout", lambda *a: "fused")
    fused = LLM(str(BASE), enable_lora=True, max_loras=2, max_lora_rank=8, **KW)
    assert "wq+wk+wv" in fused.engine.runner.params["layers"]
    ps = prompts(4, seed=2)
    for req in (adapters["all"], adapters["attn"]):
        same(
            fused.generate(ps, GREEDY, use_tqdm=False, lora_request=req),
            llm.generate(ps, GREEDY, use_tqdm=False, lora_request=req),
        )
