"""The device-facing runner: no recompilation after warm-up, donation, width buckets, multi-step."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from model_testing import forward_logits

from jaxserve import LLM, SamplingParams
from jaxserve.bench.core import CompileCounter
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.layers.linear import FusedWeight, TransposedWeight
from jaxserve.loading.dummy import dummy_params
from jaxserve.resolve import AUTO_CPU_MATMUL
from jaxserve.runner import input_batch, steps
from jaxserve.runner.blueprint import blueprint
from jaxserve.runner.runner import ModelRunner

KW = dict(
    load_format="dummy",
    dtype="float32",
    num_slots=32,
    max_model_len=64,
    page_size=32,
    prefill_chunk_size=16,
    max_num_batched_tokens=32,
)


def test_no_recompilation_after_warmup(monkeypatch):
    llm = LLM("tiny", warmup=True, **KW)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, 128, n).tolist()} for n in (1, 5, 17, 40, 62)]
    params = [
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, seed=3, max_tokens=20),
        SamplingParams(
            n=2,
            temperature=1.0,
            repetition_penalty=1.3,
            presence_penalty=0.5,
            frequency_penalty=0.2,
            logprobs=3,
            max_tokens=12,
            stop_token_ids=[9],
        ),
        SamplingParams(temperature=0, prompt_logprobs=2, max_tokens=5, min_tokens=3),
        # per-slot logits processors (issue 25): fixed-shape arrays, no new program
        SamplingParams(
            temperature=0.5, seed=1, max_tokens=1, logit_bias={5: 2.0}, allowed_token_ids=[5, 6]
        ),
    ]
    with CompileCounter() as counter:
        outs = llm.generate(prompts, params, use_tqdm=False)
        outs += llm.generate(prompts[::-1], params, use_tqdm=False)
        list(llm.stream(prompts[1], params[1]))
        # 24 requests of staggered lengths: decode row buckets 1 -> 32 -> 16 -> ... -> 1, slot
        # moves
        many = [{"prompt_token_ids": rng.integers(3, 128, 4 + i).tolist()} for i in range(24)]
        sps = [
            SamplingParams(temperature=0, max_tokens=2 + 2 * i, ignore_eos=True) for i in range(24)
        ]
        outs += llm.generate(many, sps, use_tqdm=False)
        # Steps with structured-output masks: the decode forward, the masks, then the sampling
        # (steps.decode_forward / set_grammar / decode_sample), all compiled by the warm-up. The
        # tiny model has no tokenizer for llguidance (tests/test_structured_outputs.py runs the
        # real grammars on SmolLM2), so every decode row gets an all-ones mask: the tokens must
        # then equal the one-program steps' exactly.
        engine = llm.engine
        words = -(-engine.model_config.vocab_size // 32)
        monkeypatch.setattr(
            engine.structured, "sampling_rows", lambda plan: dict.fromkeys(plan.decode_slots)
        )
        monkeypatch.setattr(
            engine.structured, "fill_bitmask", lambda rows, n: np.full((n, words), -1, np.int32)
        )
        split = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.error is None for o in outs)
    assert counter.count == 0
    assert engine.runner.overlaps_grammar and bool(
        np.asarray(engine.runner.state.sampling.constrained).any()
    )
    for a, b, sp in zip(split, outs, params):
        if sp.greedy or sp.seed is not None:  # (an unseeded request draws a new seed)
            assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert llm.engine.runner.slot_buckets == (1, 4, 8, 12, 16, 24, 32)
    assert not engine.runner.prefill_strategy.splits  # one page-table width (the C++ CPU kernel)
    st = llm.stats()
    assert st["num_slot_moves"] > 0 and 2 < st["mean_decode_rows"] < 32


def test_sampling_compiles_once_per_row_bucket():
    """A step's sampling half (`steps.decode_sample`, `steps.prefill_sample`) reads only the
    logits' rows and num_top, so there is one program per row bucket however many page-table
    widths or live-page buckets the forward half has ('ragged' here; a GPU engine has ~9
    widths): the sampler is not compiled again into every width's program."""
    # settings no other test in this file uses, so no program of theirs is in jit's cache; the
    # fewest programs that keep more shapes than row buckets on both halves: decode rows 1 and 4
    # (4 on two live-page buckets), prefill rows 1 and 2 (one chunk length) x 3 widths
    llm = LLM(
        "tiny",
        load_format="dummy",
        dtype="float32",
        num_slots=4,
        max_model_len=24,
        page_size=8,
        prefill_chunk_size=8,
        max_num_batched_tokens=16,
        attention_impl="ragged",
    )
    runner = llm.engine.runner
    shapes = runner.resolved.decode_shapes()
    rows = {s.rows for s in shapes}
    assert runner.overlaps_grammar and len(shapes) > len(rows) > 1
    before = steps.decode_sample._cache_size(), steps.decode_forward._cache_size()
    for shape in shapes:  # what warm-up runs for decode (every slot inactive)
        runner.generate(shape)
    after = steps.decode_sample._cache_size(), steps.decode_forward._cache_size()
    assert (after[0] - before[0], after[1] - before[1]) == (len(rows), len(shapes))

    shapes = runner.resolved.prefill_shapes()  # rows x widths, plus the prompt-logprobs variant
    rows = {s.rows for s in shapes}
    assert runner.prefill_strategy.splits and len(shapes) > len(rows) > 1
    before = steps.prefill_sample._cache_size(), steps.prefill_forward._cache_size()
    for shape in shapes:  # what warm-up runs for prefill (every row padding)
        runner.prefill(input_batch.padding_batch(shape.rows, 8, shape.chunk), shape)
    after = steps.prefill_sample._cache_size(), steps.prefill_forward._cache_size()
    assert (after[0] - before[0], after[1] - before[1]) == (len(rows), len(shapes))


def test_split_prefill_equals_the_one_program_prefill():
    """With width buckets, one device group runs prefill as two programs (`prefill_forward`,
    `prefill_sample`); the one-program `steps.prefill` (what each data shard, and an engine with
    one width, runs) gives the same bits: sampled tokens, their log-probs and ranks, and every
    prompt token's log-probs."""
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 17, 40)]
    sps = [
        SamplingParams(temperature=1.0, seed=5, max_tokens=6, logprobs=3, prompt_logprobs=2),
        SamplingParams(temperature=0, max_tokens=4, logprobs=0),
        SamplingParams(temperature=0.7, top_k=7, seed=2, max_tokens=5, prompt_logprobs=0),
    ]
    kw = {**KW, "attention_impl": "ragged"}  # width buckets: the engine splits its prefill
    llm = LLM("tiny", **kw)
    assert llm.engine.runner.prefill_strategy.splits
    split = llm.generate(prompts, sps, use_tqdm=False)

    one = LLM("tiny", **kw)
    one.engine.runner.prefill_strategy.splits = False  # the one-program path (`steps.prefill`)
    fused = one.generate(prompts, sps, use_tqdm=False)

    def flat(lps):
        return [(t, v.logprob, v.rank) for e in lps or [] if e for t, v in sorted(e.items())]

    assert flat(split[0].prompt_logprobs) and flat(split[0].outputs[0].logprobs)
    for a, b in zip(split, fused):
        assert a.error is None and b.error is None
        assert flat(a.prompt_logprobs) == flat(b.prompt_logprobs)
        for x, y in zip(a.outputs, b.outputs):
            assert x.token_ids == y.token_ids
            assert flat(x.logprobs) == flat(y.logprobs)


def test_a_lone_prompt_logprobs_request_runs_one_row(monkeypatch):
    """Prompt log-probs have a 1-row program beside the full-row one (`prompt_logprob_rows`): a
    lone request (lm-evaluation-harness sends them one at a time) runs no padding rows through
    the model. In a batch, the rows that did not ask skip their [T, V] logits. Both give the
    same bits."""
    llm = LLM("tiny", **KW)
    runner = llm.engine.runner
    shapes = []
    real = runner.prefill
    monkeypatch.setattr(
        runner, "prefill", lambda batch, shape, *a: shapes.append(shape) or real(batch, shape, *a)
    )
    want = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    plain = SamplingParams(temperature=0, max_tokens=2)
    prompt = {"prompt_token_ids": list(range(3, 40))}  # three 16-token chunks
    others = [{"prompt_token_ids": list(range(50, 50 + n))} for n in (9, 12)]

    alone = llm.generate([prompt], want, use_tqdm=False)[0]
    assert {(s.rows, s.prompt_logprobs) for s in shapes} == {(1, True)}
    shapes.clear()
    mixed = llm.generate([others[0], prompt, others[1]], [plain, want, plain], use_tqdm=False)
    assert (runner.resolved.prefill_rows[-1], True) in {(s.rows, s.prompt_logprobs) for s in shapes}

    def flat(lps):
        return [(t, v.logprob, v.rank) for e in lps[1:] for t, v in sorted(e.items())]

    assert len(alone.prompt_logprobs) == 37 and all(o.prompt_logprobs is None for o in mixed[::2])
    assert flat(mixed[1].prompt_logprobs) == flat(alone.prompt_logprobs)  # the same bits
    assert mixed[1].outputs[0].token_ids == alone.outputs[0].token_ids


def test_state_and_cache_are_donated():
    cfg = ModelConfig.preset("tiny")
    params = dummy_params(cfg, "float32")
    ec = EngineConfig(
        num_slots=4,
        max_model_len=64,
        page_size=32,
        dtype="float32",
        prefill_chunk_size=16,
        max_num_batched_tokens=32,
    )
    runner = ModelRunner(params, blueprint(params, cfg, ec, 8))
    old_cache, old_last = runner.cache.k, runner.state.last_token
    jax.block_until_ready(runner.generate(runner.resolved.decode_shapes()[0]))
    assert old_cache.is_deleted() and old_last.is_deleted()
    assert runner.resolved.widths == (1, 2)
    assert runner.resolved.width_for(1) == 1 and runner.resolved.width_for(2) == 2
    with pytest.raises(ValueError, match="max_pages_per_seq"):
        runner.resolved.width_for(3)


def test_multistep_decode_equals_single_step():
    prompts = [{"prompt_token_ids": [5 + i, 9, 11 + 2 * i]} for i in range(6)]
    params = [
        SamplingParams(temperature=0.7, seed=i, max_tokens=3 + 5 * i, ignore_eos=True)
        for i in range(6)
    ]
    one = LLM("tiny", **KW).generate(prompts, params, use_tqdm=False)
    multi_llm = LLM("tiny", decode_steps=4, **KW)
    multi = multi_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in multi] == [o.outputs[0].token_ids for o in one]
    assert [len(o.outputs[0].token_ids) for o in multi] == [3 + 5 * i for i in range(6)]
    st = multi_llm.stats()
    assert st["num_d2h_transfers"] == st["num_steps"]
    assert st["num_steps"] < max(3 + 5 * i for i in range(6))  # 4 tokens per round trip


def test_runner_stores_plain_layer_weights_transposed_on_cpu():
    """On CPU the runner keeps each plain [L, in, out] linear weight as [L, out, in]
    (`linear.TransposedWeight`, JOURNAL.md section 21); the model computes the same logits with it.
    A GPU engine (resolved for "gpu", built here without running) keeps them [L, in, out], with
    q/k/v and gate/up each concatenated into one stack (`linear.FusedWeight`)."""
    cfg = ModelConfig.preset("tiny")
    params = dummy_params(cfg, "float32")
    ec = EngineConfig(num_slots=4, max_model_len=64, page_size=32, dtype="float32").for_model(cfg)
    gpu = ModelRunner(params, blueprint(params, cfg, ec, 8, backend="gpu"))
    on_gpu = gpu.params["layers"]
    assert sorted(n for n, w in on_gpu.items() if isinstance(w, FusedWeight)) == [
        "w_gate+w_up",
        "wq+wk+wv",
    ]
    assert all(isinstance(w, jax.Array) for w in on_gpu.values() if not isinstance(w, FusedWeight))
    runner = ModelRunner(params, blueprint(params, cfg, ec, 8, backend="cpu"))
    layers = runner.params["layers"]
    for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        assert isinstance(layers[name], TransposedWeight), name
        assert layers[name].shape == params["layers"][name].shape
    assert layers["attn_norm"] is params["layers"]["attn_norm"]
    seq = np.arange(3, 23, dtype=np.int32)[None]
    np.testing.assert_allclose(
        forward_logits(runner.params, cfg, seq), forward_logits(params, cfg, seq), atol=1e-4
    )


def test_cpu_engine_decodes_through_the_cpu_kernel():
    """On CPU 'auto' attention is the C++ kernel (`cpu_kernels/`), one decode program per slot
    bucket; its greedy tokens equal the XLA 'ragged' path's and the reference's."""
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (1, 9, 30, 44)]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kw = {**KW, "num_slots": 8}
    tokens = {}
    for impl in ("auto", "ragged", "reference"):
        llm = LLM("tiny", attention_impl=impl, **kw)
        tokens[impl] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        if impl == "auto":
            r = llm.engine.runner.resolved
            assert r.model.attention == "cpu_kernel"
            assert [s.rows for s in r.decode_shapes()] == [1, 4, 8]
    assert tokens["auto"] == tokens["ragged"] == tokens["reference"]


def test_cpu_engine_multiplies_through_the_cpu_matmul():
    """bf16 on CPU: matmul_impl='cpu_kernel' (what 'auto' is where the kernel's loop is in
    AUTO_CPU_MATMUL) stores the layer weights for the C++ matmul, which reads each layer in
    place (the decode program calls it, and slices no weight out of the stacks); its logits equal
    XLA's dot's to bf16 rounding, and both engines agree on greedy tokens."""
    from cpu_kernels import matmul as cpu_matmul

    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (1, 9, 30)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    kw = {**KW, "num_slots": 8, "dtype": "bfloat16"}
    auto = LLM("tiny", **kw).engine.runner.resolved.model.cpu_matmul
    assert auto == (cpu_matmul.path() in AUTO_CPU_MATMUL)
    tokens = {}
    for impl in ("cpu_kernel", "xla"):
        llm = LLM("tiny", matmul_impl=impl, **kw)
        runner = llm.engine.runner
        weights = runner.params["layers"]
        assert {w.kernel for w in weights.values() if isinstance(w, TransposedWeight)} == {
            impl == "cpu_kernel"
        }
        tokens[impl] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        shape = runner.resolved.decode_shape(7, [1] * 8)
        text = (
            steps.generate.lower(
                runner.params, runner.cache, runner.state, np.bool_(False),
                config=runner.model_config, impl=runner.resolved.model, shape=shape, num_steps=1,
            ).as_text()
        )  # fmt: skip
        assert ("jaxserve_matmul" in text) == (impl == "cpu_kernel")
    assert tokens["cpu_kernel"] == tokens["xla"]


def test_the_cpu_matmul_gives_a_prompt_its_bits_alone_and_in_a_512_row_prefill():
    """matmul_impl='cpu_kernel' takes every batch: a prompt prefilled alone (a 64-row step) and
    among seven others (one 512-row step) gets the same log-probs to the bit. When the kernel
    took batches of up to 256 rows and XLA's dot the larger ones, these differed at bf16
    rounding (JOURNAL.md 40e). SmolLM2's layer widths, so that rounding shows."""
    import dataclasses

    config = dataclasses.replace(
        ModelConfig.preset("tiny"), hidden_size=576, intermediate_size=1536, num_layers=2,
        head_dim=64, name="tiny-wide",
    )  # fmt: skip
    llm = LLM(
        config, load_format="dummy", dtype="bfloat16", matmul_impl="cpu_kernel", num_slots=8,
        max_model_len=128, page_size=16, prefill_chunk_size=64, max_num_batched_tokens=512,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, config.vocab_size, 64).tolist() for _ in range(8)]
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2)

    def run(batch):
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], sp, use_tqdm=False)
        return [
            [sorted((t, lp.logprob) for t, lp in step.items()) for step in o.outputs[0].logprobs]
            for o in outs
        ]

    together = run(prompts)
    assert llm.engine.runner.resolved.prefill_rows[-1] * 64 == 512
    for i in (0, 5):
        assert run([prompts[i]])[0] == together[i]


def test_a_short_chunk_gets_its_bits_in_the_short_and_the_full_chunk_program(monkeypatch):
    """On CPU a step whose chunks all fit 16 tokens runs a [R, 16] prefill program, not [R, 64]
    (`Resolved.chunks`): a 10-token prompt prefilled alone (the short program) and beside a
    40-token one (the full program) gets the same log-probs to the bit, as does a prefix-cache
    hit whose 3-token tail runs the short program. SmolLM2's layer widths, bf16, the CPU matmul."""
    import dataclasses

    config = dataclasses.replace(
        ModelConfig.preset("tiny"), hidden_size=576, intermediate_size=1536, num_layers=2,
        head_dim=64, name="tiny-wide",
    )  # fmt: skip
    kw = dict(
        load_format="dummy", dtype="bfloat16", matmul_impl="cpu_kernel", num_slots=4,
        max_model_len=128, page_size=16, prefill_chunk_size=64, max_num_batched_tokens=256,
    )  # fmt: skip
    llm = LLM(config, **kw)
    assert llm.engine.runner.resolved.chunks == (16, 64)
    chunks = []
    prefill = llm.engine.runner.prefill
    monkeypatch.setattr(
        llm.engine.runner, "prefill", lambda b, s, *a: chunks.append(s.chunk) or prefill(b, s, *a)
    )
    rng = np.random.default_rng(0)
    short, long = (rng.integers(3, config.vocab_size, n).tolist() for n in (10, 40))
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2)

    def run(llm, batch):
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], sp, use_tqdm=False)
        logprobs = [
            [sorted((t, lp.logprob) for t, lp in step.items()) for step in o.outputs[0].logprobs]
            for o in outs
        ]
        return logprobs, [o.num_cached_tokens for o in outs]

    alone, _ = run(llm, [short])
    assert chunks == [16]
    together, _ = run(llm, [short, long])
    assert chunks[1:] == [64] and together[0] == alone[0]

    cached = LLM(config, enable_prefix_caching=True, **kw)
    prompt = long[:35]  # 2 full pages, then a 3-token tail
    first, num_cached = run(cached, [prompt])  # 35 tokens: the full program
    assert num_cached == [0]
    hit, num_cached = run(cached, [prompt])  # the tail alone: the short program
    assert num_cached == [32] and hit == first


def test_cpu_engine_falls_back_to_ragged_without_a_compiler(tmp_path):
    """No C++ compiler: 'auto' runs the XLA paths, attention and matmuls (with warnings); asking
    for either 'cpu_kernel' is an error naming the reason. A fresh process: the kernel's build is cached per process."""
    import os
    import subprocess
    import sys

    code = """
from jaxserve import LLM
kw = dict(load_format="dummy", dtype="float32", num_slots=4, max_model_len=32, page_size=8)
print(LLM("tiny", **kw).engine.runner.resolved.model.attention)
try:
    LLM("tiny", attention_impl="cpu_kernel", **kw)
except RuntimeError as e:
    print(e)
kw["dtype"] = "bfloat16"
print(LLM("tiny", **kw).engine.runner.resolved.model.cpu_matmul)
try:
    LLM("tiny", matmul_impl="cpu_kernel", **kw)
except RuntimeError as e:
    print(e)
"""
    env = {**os.environ, "CXX": "no-such-compiler", "JAXSERVE_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "ragged"
    assert "cpu_kernel" in lines[1] and "no C++ compiler" in lines[1]
    assert "CPU attention kernel not available" in proc.stderr
    assert lines[2] == "False"  # the matmuls: XLA's dot
    assert "matmul_impl='cpu_kernel'" in lines[3] and "no C++ compiler" in lines[3]
    assert "CPU matmul kernel not available" in proc.stderr


@pytest.mark.parametrize(
    "kv, num_pages, want", [("int8", 12, 7), ("int8", 16, 16), ("fp8", 9, 7), ("auto", 12, 12)]
)
def test_gpu_runner_keeps_one_byte_pools_where_the_kernels_read_them(
    monkeypatch, kv, num_pages, want
):
    """A Pallas (GPU) engine lowers an int8 / fp8 pool whose array would hold 2^31 elements or
    more but under 4 GiB, which the Triton kernels misread (JOURNAL.md 48), and allocates and
    reports the lowered count. Here the limit is scaled down to the tiny model's 1,024-element
    pages: 8-15 pages are in the range, 16 are past it."""
    from jaxserve.layers import kv_cache

    monkeypatch.setattr(kv_cache, "TRITON_OFFSET_LIMIT", 8 * 1024)
    cfg = ModelConfig.preset("tiny")
    ec = EngineConfig(
        num_slots=2, max_model_len=64, page_size=16, dtype="float32", kv_cache_dtype=kv
    ).for_model(cfg)
    params = dummy_params(cfg, "float32")
    runner = ModelRunner(params, blueprint(params, cfg, ec, num_pages, backend="gpu"))
    assert runner.num_pages == runner.cache.num_pages == want
    cpu = ModelRunner(params, blueprint(params, cfg, ec, num_pages, backend="cpu"))
    assert cpu.num_pages == num_pages  # the XLA paths index with 64-bit offsets where needed
